"""Prefill on one backend, decode on another, over one paged cache (standard attention layers).

All standard backends share the cache layout of attention/backend.py KVCache ([num_blocks, 2,
block_size, kv_heads, head_size], FP8 as stored = real / scale with the scales beside it), so a
layer writes each new token's K/V once and either backend reads it. This is what MLAAttention
(attention/mla/layer.py) does for MLA, for the same reason: the fastest prefill kernel and the
fastest decode kernel of a problem need not be the same backend's (on an H100, FlashInfer 0.7's
prefill and TRITON's decode at short contexts; docs/attention-backends.md).

`phase_split_backend(prefill_cls, decode_cls)` makes the class: an AttentionBackend whose
capabilities are what both parts serve, and whose name reads "FLASHINFER prefill + TRITON
decode". The registry hands it out like any backend class (for `--attention-backend
prefill=FLASHINFER,decode=TRITON`, or where kernel_choice.py's table says a split pays).

A step (prefills first, then decodes) is cut by metadata.split_prefill_decode; each part is
planned by its backend and run on its rows; the outputs (and LSEs) are concatenated in batch
order. Decode CUDA graphs plan and replay through the decode backend alone. K/V writes:
`fused_kv_write` only when both parts take meshserve's paged write (kernels.write_kv, as the
model's fused rotary write does); otherwise write_kv goes through the decode backend's own
write, which every standard backend implements to the same layout and quantisation (the
scenario table checks each backend against the oracle after its own write).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from math import lcm
from typing import ClassVar

import numpy as np
import torch

from meshserve.attention.backend import (
    AttentionBackend,
    AttentionProblem,
    BackendCapabilities,
    KVCache,
    LayerParams,
)
from meshserve.attention.metadata import AttentionMetadata, split_prefill_decode
from meshserve.core.attention_options import split_spelling
from meshserve.errors import ConfigError


@dataclass(frozen=True)
class PhaseSplitPlan:
    """One step: its metadata, and each part's plan by its backend (None: the part is empty)."""

    metadata: AttentionMetadata
    prefill_plan: object | None
    decode_plan: object | None


def combined_capabilities(prefill: BackendCapabilities, decode: BackendCapabilities) -> BackendCapabilities:
    """What a layer running `prefill`'s backend for prefills and `decode`'s for decodes serves:
    every feature both serve (a step may hold both phases); CUDA graphs as the decode backend
    (decode graphs run decode steps only; steps with prefills run attention eagerly)."""
    both = {}
    for f in fields(BackendCapabilities):
        a, b = getattr(prefill, f.name), getattr(decode, f.name)
        if isinstance(a, frozenset):
            both[f.name] = a & b
        elif isinstance(a, bool):
            both[f.name] = a and b
        elif f.name.startswith("min_"):
            both[f.name] = b if a is None else a if b is None else max(a, b)
        elif f.name.startswith("max_"):
            both[f.name] = b if a is None else a if b is None else min(a, b)
    both["head_size_multiple"] = lcm(prefill.head_size_multiple, decode.head_size_multiple)
    both["required_packages"] = tuple(dict.fromkeys(prefill.required_packages + decode.required_packages))
    both["cuda_graphs"] = decode.cuda_graphs
    both["notes"] = "prefill and decode on two backends over one cache (attention/backends/phase_split.py)"
    return BackendCapabilities(**both)


class PhaseSplitBackend(AttentionBackend):
    """Base of the classes phase_split_backend makes; `prefill_backend` / `decode_backend` are
    the two parts' classes."""

    prefill_backend: ClassVar[type[AttentionBackend]]
    decode_backend: ClassVar[type[AttentionBackend]]
    spelling: ClassVar[str]  # the setting that names it: "prefill=FLASHINFER,decode=TRITON"

    def __init__(self, problem: AttentionProblem) -> None:
        super().__init__(problem)
        self.prefill = self.prefill_backend(problem)
        self.decode = self.decode_backend(problem)

    @classmethod
    def validate_configuration(cls, problem: AttentionProblem) -> list[str]:
        """Every reason either part refuses `problem`, each prefixed with its phase."""
        return [f"{phase} backend {part.name}: {r}" for phase, part in (("prefill", cls.prefill_backend),
                                                                          ("decode", cls.decode_backend))
                for r in part.validate_configuration(problem)]  # fmt: skip

    def plan(self, metadata: AttentionMetadata) -> PhaseSplitPlan:
        prefill, decode = split_prefill_decode(metadata)
        return PhaseSplitPlan(metadata, None if prefill is None else self.prefill.plan(prefill),
                              None if decode is None else self.decode.plan(decode))  # fmt: skip

    def plan_for_graph(self, metadata: AttentionMetadata) -> PhaseSplitPlan:
        """A decode graph's plan: the decode backend's, over the graph's static buffers."""
        return PhaseSplitPlan(metadata, None, self.decode.plan_for_graph(metadata))

    def prepare_replay(self, plan: object, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        self.decode.prepare_replay(plan.decode_plan, seq_lens, block_tables)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        *,
        plan: object | None = None,
    ) -> None:
        """The whole step's K/V in one write, the decode backend's (its plan covers only the
        decode rows, so none is passed: the result is the same without it)."""
        self.decode.write_kv(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: KVCache | None,
        plan: object,
        *,
        layer: LayerParams = LayerParams(),
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D] -> [T, H, Dv] (and LSE [T, H]): rows [:num_prefill_tokens] by the
        prefill backend, the rest by the decode backend (see AttentionBackend.forward)."""
        if not isinstance(plan, PhaseSplitPlan):
            raise ConfigError("plan", type(plan).__name__, f"the PhaseSplitPlan returned by {self.name}.plan")
        if plan.prefill_plan is None or plan.decode_plan is None:  # one phase: no slicing, no copy
            part, part_plan = ((self.prefill, plan.prefill_plan) if plan.decode_plan is None
                               else (self.decode, plan.decode_plan))  # fmt: skip
            return part.forward(query, key, value, kv_cache, part_plan, layer=layer, return_lse=return_lse)
        cut = plan.metadata.num_prefill_tokens

        def rows(x: torch.Tensor | None, part: slice) -> torch.Tensor | None:
            return None if x is None else x[part]

        head, tail = slice(None, cut), slice(cut, None)
        first = self.prefill.forward(query[head], rows(key, head), rows(value, head), kv_cache, plan.prefill_plan,
                                     layer=layer, return_lse=return_lse)  # fmt: skip
        second = self.decode.forward(query[tail], rows(key, tail), rows(value, tail), kv_cache, plan.decode_plan,
                                     layer=layer, return_lse=return_lse)  # fmt: skip
        if not return_lse:
            return torch.cat((first, second))
        return torch.cat((first[0], second[0])), torch.cat((first[1], second[1]))


@cache
def phase_split_backend(prefill: type[AttentionBackend], decode: type[AttentionBackend]) -> type[PhaseSplitBackend]:
    """The backend class running `prefill` for a step's prefill rows and `decode` for its decode
    rows (one class per pair: equal pairs give the same class)."""
    for phase, part in (("prefill", prefill), ("decode", decode)):
        if isinstance(part, type) and issubclass(part, PhaseSplitBackend):
            raise ConfigError(f"{phase} backend", part.name, "a single backend, not a phase split")
    return type(
        f"PhaseSplit_{prefill.name}_{decode.name}",
        (PhaseSplitBackend,),
        {
            "name": f"{prefill.name} prefill + {decode.name} decode",
            "spelling": split_spelling(prefill.name, decode.name),
            "prefill_backend": prefill,
            "decode_backend": decode,
            "capabilities": combined_capabilities(prefill.capabilities, decode.capabilities),
            "fused_kv_write": prefill.fused_kv_write and decode.fused_kv_write,
            "__module__": __name__,
        },
    )
