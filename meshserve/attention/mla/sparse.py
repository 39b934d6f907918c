"""The sparse MLA backend interface: MLA over each query token's own chosen cache rows.

Sparse MLA backends (DeepSeek-V3.2) have their own registry table (BackendKind.MLA_SPARSE). They
take what dense MLA backends take plus `rows` [T, k] int32: per query token, the rows of this
rank's latent cache it attends to (-1: unused column), as the lightning indexer chose them
(attention/mla/indexer.py). No causal mask is applied: the indexer chose visible rows only.
One backend serves prefill and decode tokens alike (every query token is its own problem).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from meshserve.attention.backend import AttentionProblem
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.backend import MLABackend, MLAWeights
from meshserve.attention.mla.cache import LatentCache
from meshserve.errors import ConfigError, check

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # o, or (o, lse) with return_lse


def sparse_reasons(problem: AttentionProblem) -> list[str]:
    """Why `problem` is not a sparse MLA layer (empty when it is); a dense MLA backend's capability
    record refuses sparse layers itself (`sparse_mla`)."""
    mla = problem.spec.mla
    if mla is None or mla.indexer is None:
        return ["not a sparse MLA layer (spec.mla.indexer is None): dense MLA layers use the MLA tables"]
    return []


@dataclass(frozen=True)
class SparsePlan:
    """One step, shared by every layer.

    token_seq [T] int32: the sequence (block-table row) of each query token
    """

    metadata: AttentionMetadata
    token_seq: torch.Tensor


class SparseMLABackend(MLABackend):
    """Base class of sparse MLA backends: `plan` once per step, `forward(..., rows=)` per layer."""

    @classmethod
    def validate_configuration(cls, problem: AttentionProblem) -> list[str]:
        return super().validate_configuration(problem) + sparse_reasons(problem)

    def plan(self, metadata: AttentionMetadata) -> SparsePlan:
        device = metadata.query_start_loc.device
        token_seq = torch.repeat_interleave(
            torch.arange(len(metadata.query_lens_host), dtype=torch.int32, device=device),
            torch.tensor(metadata.query_lens_host, device=device),
            output_size=metadata.num_tokens,
        )
        return SparsePlan(metadata, token_seq)

    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: object,
        weights: MLAWeights,
        *,
        rows: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> Output:
        """query [T, H, nope + rope], rows [T, k] int32 -> o [T, H, v_head_dim] (and LSE [T, H] f32)."""
        if not isinstance(plan, SparsePlan):
            raise ConfigError("plan", type(plan).__name__, "the SparsePlan returned by this backend's plan")
        tokens = plan.metadata.num_tokens
        self._check_inputs(query, weights, tokens)
        shape = None if rows is None else tuple(rows.shape)
        check(shape is not None and len(shape) == 2 and shape[0] == tokens, "rows", shape,
              f"[{tokens}, k] int32 chosen cache rows per token")  # fmt: skip
        return self.attend_rows(query, cache, plan, weights, rows, return_lse=return_lse)

    @abstractmethod
    def attend_rows(self, query: torch.Tensor, cache: LatentCache, plan: SparsePlan, weights: MLAWeights,
                    rows: torch.Tensor, *, return_lse: bool) -> Output:
        """The backend's computation; inputs already checked."""


def row_slots(plan: SparsePlan, rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [T, k] int64 flat cache slots of the chosen rows (0 where unused), used [T, k] bool)."""
    used = rows >= 0
    local = rows.clamp(min=0).long()
    blocks = plan.metadata.block_table[plan.token_seq.long()[:, None], local // block_size].long()
    return torch.where(used, blocks * block_size + local % block_size, 0), used
