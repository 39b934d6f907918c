"""One sparse MLA layer's step (DeepSeek-V3.2): write latent rows and index keys, choose, attend.

Per layer the model calls `write_kv` (latent rows, as dense MLA), `index` (store the new tokens'
indexer keys, then choose each query token's top-k cache rows) and `forward` with those rows.
`plan` runs once per step. The choice is this module's; the attention over the chosen rows is
the sparse backend's (TORCH reference or TRITON, from the MLA_SPARSE registry table).
The DCP version (parallel/dcp_mla.py) merges the ranks' candidate lists before attending.
"""

from __future__ import annotations

import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.cache import LatentCache, write_latent_kv
from meshserve.attention.mla.indexer import TopK, index_candidates, write_index_keys
from meshserve.attention.mla.sparse import SparseMLABackend, SparsePlan, sparse_reasons
from meshserve.attention.registry import BackendKind, select_backend
from meshserve.errors import NoBackendError


class SparseMLAAttention:
    """The sparse MLA of every layer that shares one spec.

    backend: a registered sparse MLA backend name (validated), None for the platform's first
    valid one, or a ready instance (tests).
    """

    def __init__(self, problem: AttentionProblem, *, backend: str | SparseMLABackend | None = None) -> None:
        reasons = sparse_reasons(problem)
        if reasons:
            raise NoBackendError("; ".join(reasons))
        self.problem = problem
        self.topk = problem.spec.mla.indexer.topk
        if not isinstance(backend, SparseMLABackend):
            backend = select_backend(problem, backend, kind=BackendKind.MLA_SPARSE)(problem)
        self.backend = backend

    @classmethod
    def named(cls, problem: AttentionProblem, name: str | None) -> SparseMLAAttention:
        """One engine-wide backend name: taken when the sparse table has it; a dense-MLA-only name
        (FLASHINFER) leaves the choice to priority; any other name fails listing the sparse table."""
        from meshserve.attention.registry import MLA_DECODE_BACKENDS, MLA_SPARSE_BACKENDS

        dense_only = name is not None and name.upper() in set(MLA_DECODE_BACKENDS) - set(MLA_SPARSE_BACKENDS)
        return cls(problem, backend=None if dense_only else name)

    @property
    def name(self) -> str:
        return f"SparseMLA({self.backend.name}, top-{self.topk})"

    def graph_refusal(self) -> str | None:
        """Why decode steps stay eager (never None yet): the indexer scores a step's keys up to its
        longest sequence, which a graph would fix at max_model_len for every row (a cost that grows
        with max_model_len, not with the lengths served), and its plan copies host lists."""
        return ("sparse MLA (DeepSeek-V3.2 indexer) captures no CUDA graphs: its top-k scoring is sized "
                "by the step's longest sequence on the host")

    def plan(self, metadata) -> SparsePlan:
        return self.backend.plan(metadata)

    def width(self, plan: SparsePlan) -> int:
        """Columns of the step's top-k lists: index_topk, or fewer when no sequence is that long."""
        return max(1, min(self.topk, plan.metadata.max_seq_len))

    def write_kv(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: LatentCache, plan: SparsePlan) -> None:
        """Store the step's new tokens: latent [T, kv_lora_rank] (normalised), k_pe [T, rope] (rotated)."""
        write_latent_kv(latent, k_pe, cache, plan.metadata.slot_mapping)

    def candidates(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cache: LatentCache,
                   plan: SparsePlan) -> TopK:  # fmt: skip
        """Store the new index keys [T, D], then this rank's top-k per token over the keys it holds."""
        write_index_keys(keys, cache, plan.metadata.slot_mapping)
        return index_candidates(q, weights, cache, plan.metadata, self.width(plan))

    def index(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cache: LatentCache,
              plan: SparsePlan) -> torch.Tensor:  # fmt: skip
        """q [T, Hi, D], head weights [T, Hi], new keys [T, D] -> rows [T, k] int32 to attend to."""
        meta = plan.metadata
        return self.candidates(q, weights, keys, cache, plan).local_rows(meta.dcp_size, meta.dcp_rank)

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: SparsePlan,
        weights: MLAWeights,
        *,
        rows: torch.Tensor,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, nope + rope] -> o [T, H, v_head_dim] (and LSE [T, H]) over each token's rows."""
        return self.backend.forward(query, cache, plan, weights, rows=rows, return_lse=return_lse)
