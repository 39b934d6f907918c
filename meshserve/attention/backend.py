"""The attention backend interface: declared capabilities, validation, plan once, forward per layer.

A backend declares what it supports as one frozen `BackendCapabilities` record. The registry,
the CLI table, the generated docs and the tests' skips all read that record; nothing restates
it. `validate_configuration` turns the record into every reason a problem cannot be served.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8_DTYPES = {KVCacheDtype.FP8_E4M3: torch.float8_e4m3fn, KVCacheDtype.FP8_E5M2: torch.float8_e5m2}


@dataclass(frozen=True)
class AttentionProblem:
    """Everything a backend needs to know to say whether it can serve a configuration.

    block_size == max_model_len selects the naive layout (one contiguous block per request,
    materialised scores); block_size < max_model_len selects paged flash attention.
    """

    spec: AttentionSpec
    dtype: str = "float32"  # model activation dtype: one of DTYPES
    block_size: int = 16
    max_model_len: int = 2048
    device: str = "cpu"  # "cpu" or "cuda"
    compute_capability: tuple[int, int] | None = None  # (major, minor) on CUDA
    needs_lse: bool = False  # DCP needs (o, lse) from every layer
    dcp_size: int = 1  # > 1: the cache holds every dcp_size-th token (see AttentionMetadata)

    @property
    def is_naive_layout(self) -> bool:
        return self.block_size == self.max_model_len


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend supports, declared once as data."""

    dtypes: frozenset[str]
    kv_cache_dtypes: frozenset[KVCacheDtype]
    min_block_size: int
    max_block_size: int
    naive_layout: bool  # serves block_size == max_model_len
    paged_layout: bool  # serves block_size < max_model_len
    min_head_size: int
    max_head_size: int
    head_size_multiple: int  # 1: any head size
    attention_types: frozenset[AttentionType]
    sliding_window: bool
    learned_sinks: bool
    sink_tokens: bool
    alibi: bool
    soft_cap: bool
    mla: bool
    returns_lse: bool
    devices: frozenset[str]
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    required_packages: tuple[str, ...] = ()
    cuda_graphs: bool = False
    dcp: bool = False  # reads DCP-sharded caches with global positions (metadata.dcp_size/dcp_rank)
    sparse_mla: bool = False  # attends to per-token chosen rows (DeepSeek-V3.2 indexer top-k)
    notes: str = ""

    def reasons(self, problem: AttentionProblem) -> list[str]:
        """Every reason these capabilities cannot serve `problem` (empty when they can)."""
        spec = problem.spec
        out: list[str] = []
        for pkg in self.required_packages:
            if importlib.util.find_spec(pkg) is None:
                out.append(f"package '{pkg}' is not installed")
        if problem.device not in self.devices:
            out.append(f"device '{problem.device}' not supported (supports {sorted(self.devices)})")
        cc = problem.compute_capability
        if problem.device == "cuda" and cc is not None:
            lo, hi = self.min_compute_capability, self.max_compute_capability
            if (lo and cc < lo) or (hi and cc > hi):
                out.append(f"compute capability {cc[0]}.{cc[1]} outside [{_cc(lo)}, {_cc(hi)}]")
        if problem.dtype not in self.dtypes:
            out.append(f"dtype '{problem.dtype}' not supported (supports {sorted(self.dtypes)})")
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            allowed = sorted(str(d) for d in self.kv_cache_dtypes)
            out.append(f"kv_cache_dtype '{spec.kv_cache_dtype}' not supported (supports {allowed})")
        if spec.attn_type not in self.attention_types:
            allowed = sorted(str(t) for t in self.attention_types)
            out.append(f"attention type '{spec.attn_type}' not supported (supports {allowed})")
        out += self._layout_reasons(problem)
        head_sizes = {spec.head_size, spec.v_size}
        for hs in sorted(head_sizes):
            if not (self.min_head_size <= hs <= self.max_head_size) or hs % self.head_size_multiple:
                out.append(
                    f"head size {hs} not supported (supports {self.min_head_size}..{self.max_head_size}"
                    f"{'' if self.head_size_multiple == 1 else f', multiples of {self.head_size_multiple}'})"
                )
        features = [
            (spec.sliding_window is not None, self.sliding_window, "sliding window"),
            (spec.has_sinks, self.learned_sinks, "learned sink logits"),
            (spec.num_sink_tokens > 0, self.sink_tokens, "StreamingLLM sink tokens"),
            (spec.use_alibi, self.alibi, "ALiBi"),
            (spec.logits_soft_cap is not None, self.soft_cap, "logit soft-cap"),
            (spec.mla is not None, self.mla, "multi-head latent attention"),
            (spec.mla is not None and spec.mla.indexer is not None, self.sparse_mla, "sparse MLA (indexer top-k)"),
            (problem.needs_lse or problem.dcp_size > 1, self.returns_lse, "returning the LSE (needed by DCP)"),
            (problem.dcp_size > 1, self.dcp, "DCP-sharded KV cache"),
        ]
        if problem.dcp_size > 1 and spec.attn_type is not AttentionType.DECODER:
            out.append(f"DCP applies to decoder attention only, not '{spec.attn_type}'")
        out += [f"{name} not supported" for wanted, has, name in features if wanted and not has]
        return out

    def _layout_reasons(self, problem: AttentionProblem) -> list[str]:
        spec, bs, mml = problem.spec, problem.block_size, problem.max_model_len
        if bs < 1 or mml < 1:
            return [f"block_size={bs} and max_model_len={mml} must both be >= 1"]
        if bs > mml:
            return [f"block_size={bs} is larger than max_model_len={mml}"]
        if bs == mml:
            out = (
                []
                if self.naive_layout
                else [f"naive layout (block_size == max_model_len={mml}) not supported"]
            )
            if spec.kv_cache_dtype.is_fp8:
                out.append("the naive layout does not take an FP8 KV cache")
            if spec.has_sinks or spec.num_sink_tokens:
                out.append("the naive layout does not take sinks")
            return out
        out = [] if self.paged_layout else ["paged layout (block_size < max_model_len) not supported"]
        if bs & (bs - 1):
            out.append(f"block_size={bs} is not a power of two")
        if not (self.min_block_size <= bs <= self.max_block_size):
            out.append(f"block_size={bs} outside [{self.min_block_size}, {self.max_block_size}]")
        if mml % bs:
            out.append(f"max_model_len={mml} is not a multiple of block_size={bs}")
        return out


def step_kv_refusals(spec: AttentionSpec, dcp_size: int) -> list[str]:
    """Why a prefill's keys cannot be read from the step's own K/V (what forward is given beside
    the query) instead of the cache, whatever the step: the fresh-prefill paths of TRITON and
    FLASHINFER check this first. Empty: they can, for sequences with no cached context."""
    out = []
    if spec.attn_type is AttentionType.CROSS:
        out.append("cross attention attends over the encoder's cached keys, not the step's")
    if spec.kv_cache_dtype.is_fp8:
        out.append(f"an {spec.kv_cache_dtype} cache: prefill must read the quantized keys decode reads")
    if dcp_size > 1:
        out.append("DCP: a rank stores only its share of the step's keys")
    return out


def _cc(cc: tuple[int, int] | None) -> str:
    return "any" if cc is None else f"{cc[0]}.{cc[1]}"


@dataclass
class KVCache:
    """One layer's paged cache and its dequantisation scales.

    data: [num_blocks, 2, block_size, num_kv_heads, head_size], index 0 = K, 1 = V. Its dtype is
          the model dtype, or a float8 dtype for an FP8 cache.
    k_scale, v_scale: [] float32. Stored value = real value / scale; real = stored * scale.
    """

    data: torch.Tensor
    k_scale: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))
    v_scale: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype in FP8_DTYPES.values()


@dataclass(frozen=True)
class LayerParams:
    """Per-layer tensors that join the computation.

    sinks:        [num_heads] float32 learned sink logits (when spec.has_sinks)
    alibi_slopes: [num_heads] float32 (when spec.use_alibi)
    """

    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Base class. One instance serves every layer that shares an AttentionSpec.

    Life cycle per step: `plan(metadata)` once on the host (it may fill static buffers for
    CUDA-graph replay), then per layer `write_kv` for the new tokens and `forward`.
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    # write_kv is meshserve's paged write (kernels.write_kv: layout, FP8 quantisation, -1 skips),
    # so a model may store K/V itself in that same way, fused with its rotary embedding.
    fused_kv_write: ClassVar[bool] = False

    def __init__(self, problem: AttentionProblem) -> None:
        reasons = self.validate_configuration(problem)
        if reasons:
            from meshserve.errors import NoBackendError

            raise NoBackendError(f"{self.name} cannot serve this configuration: " + "; ".join(reasons))
        self.problem = problem
        self.spec = problem.spec

    @classmethod
    def validate_configuration(cls, problem: AttentionProblem) -> list[str]:
        """Every reason this backend cannot serve `problem`; empty when it can."""
        return cls.capabilities.reasons(problem) + cls.extra_reasons(problem)

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        """Backend-specific limits that the capability record cannot express."""
        return []

    def plan(self, metadata: AttentionMetadata) -> object:
        """Prepare per-step state shared by all layers; the returned object goes to forward."""
        return metadata

    def plan_for_graph(self, metadata: AttentionMetadata) -> object:
        """A decode plan to capture in a CUDA graph (backends declaring `cuda_graphs`).

        `metadata` holds num_decodes decode rows whose device tensors are static buffers; its
        host lengths are the longest the graph will see. The plan must stay valid when later
        steps rewrite those buffers in place with any lengths up to that, after
        `prepare_replay`; forward must read no device value on the host.
        """
        from meshserve.errors import ConfigError

        raise ConfigError("attention_backend", self.name, "a backend whose capabilities declare cuda_graphs")

    def prepare_replay(self, plan: object, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """Host work before replaying a graph captured with `plan`, for this step's lengths
        ([b] int32) and tables ([b, W] int32 host array, one row per graph row, padding
        included; entries past a row's blocks are never read). Default: nothing (the kernels
        read the static buffers directly)."""
        return None

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor, *,
        plan: object | None = None,
    ) -> None:
        """Store new tokens' K/V ([T, num_kv_heads, head_size]) at `slot_mapping` ([T]; -1 skips).

        plan: this step's `plan()` of the metadata `slot_mapping` belongs to, when the caller has
        it (the model's layers pass it): a backend may take write positions it computed there
        once per step instead of once per layer. Without it the result is the same."""

    @abstractmethod
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
        """Attention for the packed batch.

        query: [T, num_heads, head_size]; key/value: [T, num_kv_heads, head_size] (new tokens;
        already written to the cache by `write_kv` for cached attention types).
        Returns output [T, num_heads, head_size_v] in query's dtype, and with return_lse the
        natural-log LSE [T, num_heads] float32 (-inf where a query sees no key).
        """
