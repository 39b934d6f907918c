"""The MLA backend interface: latent cache in, per-head attention output out.

MLA backends live in their own registry tables (decode and prefill are chosen separately, see
registry.py). They share the problem record and the declared-capabilities record of standard
backends, so selection, refusal reasons, the CLI and the docs treat both kinds alike.

Every MLA backend computes the same thing from the same inputs:
  query   [T, H, qk_nope + qk_rope]  q_nope then the rope-rotated q_pe, per head
  cache   LatentCache, already holding the new tokens (write_latent_kv runs first)
  weights MLAWeights: the per-head up-projections W_UK, W_UV split out of kv_b_proj
and returns o [T, H, v_head_dim] (and the natural-log LSE [T, H] with return_lse), the input of
o_proj. Whether a backend expands the latent to K/V (prefill) or folds W_UK into the query and
attends in the latent space (decode) is its own business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from meshserve.attention.backend import AttentionProblem, BackendCapabilities
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.mla.cache import LatentCache
from meshserve.attention.mla.spec import mla_reasons
from meshserve.attention.spec import MLADims
from meshserve.errors import ConfigError, NoBackendError, check


@dataclass(frozen=True)
class MLAWeights:
    """Per-head up-projections of the latent, as kv_b_proj holds them.

    w_uk: [H, qk_nope_head_dim, kv_lora_rank]   k_nope[h] = w_uk[h] @ c
    w_uv: [H, v_head_dim, kv_lora_rank]         v[h]      = w_uv[h] @ c
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, num_heads: int, dims: MLADims) -> MLAWeights:
        """Split HF's kv_b_proj.weight [H * (qk_nope + v_head_dim), kv_lora_rank] per head (views)."""
        rows = dims.qk_nope_head_dim + dims.v_head_dim
        check(
            tuple(weight.shape) == (num_heads * rows, dims.kv_lora_rank),
            "kv_b_proj.weight",
            tuple(weight.shape),
            f"[{num_heads} * ({dims.qk_nope_head_dim} + {dims.v_head_dim}), {dims.kv_lora_rank}]",
        )
        per_head = weight.view(num_heads, rows, dims.kv_lora_rank)
        return cls(per_head[:, : dims.qk_nope_head_dim], per_head[:, dims.qk_nope_head_dim :])

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, qk_nope] -> q_lat [T, H, kv_lora_rank] = W_UK[h]^T q_nope[h] (q's dtype)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk.to(q_nope.dtype)).transpose(0, 1)

    def up_project(self, o_lat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o_lat [T, H, kv_lora_rank] -> o [T, H, v_head_dim] = W_UV[h] o_lat[h], in `dtype`."""
        w = self.w_uv.to(dtype).transpose(1, 2)  # [H, r, dv]
        return torch.bmm(o_lat.to(dtype).transpose(0, 1), w).transpose(0, 1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [N, kv_lora_rank] -> k_nope [N, H, qk_nope], v [N, H, v_head_dim] in latent's dtype."""
        h, dn, r = self.w_uk.shape
        dv = self.w_uv.shape[1]
        k_nope = latent @ self.w_uk.to(latent.dtype).reshape(h * dn, r).T
        v = latent @ self.w_uv.to(latent.dtype).reshape(h * dv, r).T
        return k_nope.view(-1, h, dn), v.view(-1, h, dv)


class MLABackend(ABC):
    """Base class of MLA backends. One instance serves every layer sharing an AttentionSpec.

    Life cycle per step: `plan(metadata)` once (host work, buffers), then per layer
    `forward`. The batch an instance sees is the part of the step its registry table gives it:
    decode backends get decode sequences only (one query each), prefill backends the rest.
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]

    def __init__(self, problem: AttentionProblem) -> None:
        reasons = self.validate_configuration(problem)
        if reasons:
            raise NoBackendError(f"MLA backend {self.name} cannot serve this configuration: " + "; ".join(reasons))
        self.problem = problem
        self.spec = problem.spec
        self.dims: MLADims = problem.spec.mla

    @classmethod
    def validate_configuration(cls, problem: AttentionProblem) -> list[str]:
        """Every reason this backend cannot serve `problem`; empty when it can."""
        return cls.capabilities.reasons(problem) + mla_reasons(problem.spec) + cls.extra_reasons(problem)

    @classmethod
    def extra_reasons(cls, problem: AttentionProblem) -> list[str]:
        """Backend-specific limits that the capability record cannot express."""
        return []

    def plan(self, metadata: AttentionMetadata) -> object:
        """Per-step state shared by all layers; the returned object goes to forward."""
        return metadata

    def plan_for_graph(self, metadata: AttentionMetadata) -> object:
        """A decode plan to capture in a CUDA graph (backends declaring `cuda_graphs`), with the
        contract of AttentionBackend.plan_for_graph: static device tensors in `metadata`, host
        lengths the longest the graph will see, no device value read on the host in forward."""
        raise ConfigError("mla_decode_backend", self.name, "an MLA decode backend whose capabilities declare "
                          "cuda_graphs (TRITON, FLASHINFER)")

    def prepare_replay(self, plan: object, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """Host work before replaying a graph captured with `plan`: this step's lengths ([b] int32)
        and tables ([b, W] int32 host array, padding rows included). Default: nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        cache: LatentCache,
        plan: object,
        weights: MLAWeights,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, qk_nope + qk_rope] -> o [T, H, v_head_dim] in query's dtype (and LSE [T, H] f32)."""

    def _check_inputs(self, query: torch.Tensor, weights: MLAWeights, num_tokens: int) -> None:
        spec, dims = self.spec, self.dims
        want = (num_tokens, spec.num_heads, dims.qk_head_dim)
        check(tuple(query.shape) == want, "query", tuple(query.shape), f"{list(want)} (tokens, heads, nope + rope)")
        check(
            weights.num_heads == spec.num_heads,
            "weights.num_heads",
            weights.num_heads,
            f"spec.num_heads={spec.num_heads} (the heads this rank attends with)",
        )
