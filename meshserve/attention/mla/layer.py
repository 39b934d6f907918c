"""One MLA attention layer's step: write the latent cache, prefill and decode through their backends.

The decode and prefill backends are chosen separately from their own registry tables. A step's
packed batch (prefills first, then decodes) is cut in two (metadata.split_prefill_decode): the
prefill sequences go to the prefill backend, the decode sequences to the decode backend, and the
outputs are concatenated in batch order. A model holds one MLAAttention per distinct MLA spec and calls
`plan` once per step and `write_kv` + `forward` per layer. Decode steps captured in CUDA graphs
(workers/decode_graphs.py) plan with `plan_for_graph` over static buffers and `prepare_replay`
before each replay; only the decode backend takes part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.metadata import AttentionMetadata, split_prefill_decode
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.cache import LatentCache, write_latent_kv
from meshserve.attention.registry import BackendKind, select_backend


@dataclass(frozen=True)
class MLAPlan:
    """One step: the metadata, its two parts, and each backend's plan for its part."""

    metadata: AttentionMetadata
    prefill_plan: object | None
    decode_plan: object | None


class MLAAttention:
    """The MLA attention of every layer that shares one spec: a decode and a prefill backend.

    decode_backend / prefill_backend: a registered name (validated, errors list the reasons) or
    None for the platform's first valid one; or a ready instance (tests, tuning).
    """

    def __init__(
        self,
        problem: AttentionProblem,
        *,
        decode_backend: str | MLABackend | None = None,
        prefill_backend: str | MLABackend | None = None,
    ) -> None:
        self.problem = problem
        self.decode = self._make(problem, decode_backend, BackendKind.MLA_DECODE)
        self.prefill = self._make(problem, prefill_backend, BackendKind.MLA_PREFILL)

    @classmethod
    def named(cls, problem: AttentionProblem, name: str | None) -> MLAAttention:
        """One engine-wide backend name for both phases: the prefill table takes it when it has it
        (FLASHINFER serves decode only here), else chooses by priority. A phase split
        'prefill=A,decode=B' names each phase's backend (each validated by its own table)."""
        from meshserve.attention.registry import MLA_PREFILL_BACKENDS
        from meshserve.core.attention_options import parse_attention_backend

        parsed = parse_attention_backend(name)
        if isinstance(parsed, tuple):
            return cls(problem, decode_backend=parsed[1], prefill_backend=parsed[0])
        prefill = name if name is None or name.upper() in MLA_PREFILL_BACKENDS else None
        return cls(problem, decode_backend=name, prefill_backend=prefill)

    @property
    def name(self) -> str:
        return f"MLA(decode {self.decode.name}, prefill {self.prefill.name})"

    @staticmethod
    def _make(problem: AttentionProblem, choice: str | MLABackend | None, kind: BackendKind) -> MLABackend:
        if isinstance(choice, MLABackend):
            return choice
        return select_backend(problem, choice, kind=kind)(problem)

    def plan(self, metadata: AttentionMetadata) -> MLAPlan:
        prefill, decode = split_prefill_decode(metadata)
        return MLAPlan(
            metadata,
            None if prefill is None else self.prefill.plan(prefill),
            None if decode is None else self.decode.plan(decode),
        )

    def graph_refusal(self) -> str | None:
        """Why this layer's decode steps cannot be captured in CUDA graphs (None: they can)."""
        if not self.decode.capabilities.cuda_graphs:
            return f"MLA decode backend {self.decode.name} declares no CUDA-graph support"
        return None

    def plan_for_graph(self, metadata: AttentionMetadata) -> MLAPlan:
        """A decode-only plan over a graph's static buffers (see MLABackend.plan_for_graph)."""
        return MLAPlan(metadata, None, self.decode.plan_for_graph(metadata))

    def prepare_replay(self, plan: MLAPlan, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        self.decode.prepare_replay(plan.decode_plan, seq_lens, block_tables)

    def write_kv(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, plan: MLAPlan) -> None:
        """Store the step's new tokens: latent [T, kv_lora_rank] (normalised), k_pe [T, rope] (rotated)."""
        write_latent_kv(latent, k_pe, cache, plan.metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: MLAPlan,
        weights: MLAWeights,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, qk_nope + qk_rope] -> o [T, H, v_head_dim] (and LSE [T, H]); see MLABackend."""
        npt = plan.metadata.num_prefill_tokens
        parts = []
        if plan.prefill_plan is not None:
            parts.append(self.prefill.forward(query[:npt], cache, plan.prefill_plan, weights, return_lse=return_lse))
        if plan.decode_plan is not None:
            parts.append(self.decode.forward(query[npt:], cache, plan.decode_plan, weights, return_lse=return_lse))
        if not return_lse:
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
