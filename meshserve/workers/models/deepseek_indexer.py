"""DeepSeek-V3.2's lightning indexer (HF: `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`).

Per token (DeepSeek-V3.2-Exp; HF transformers' DeepseekV32Indexer computes the same):

    q       = wq_b(q_resid)                  [Hi, D]   q_resid = q_a_layernorm(q_a_proj(x)), MLA's own
    k       = k_norm(wk(x))                  [D]       LayerNorm; one key per token, shared by the heads
    q, k    : the first qk_rope_head_dim values rope-rotated by halves (MLA rotates pairs)
    weights = weights_proj(x) / sqrt(Hi)     [Hi]

The attention layer stores k in the index key cache and picks each token's top-k keys by
sum_h weights[h] * relu(q[h] . k_t / sqrt(D)) (attention/mla/indexer.py). The indexer is small
(Hi x D query values per token) and replicated on every TP rank: each rank scores the tokens it stores.
"""

from __future__ import annotations

import torch
from torch import nn

from meshserve.attention.spec import MLADims
from meshserve.errors import check
from meshserve.workers.models.yarn_rope import YarnRotary


class Indexer(nn.Module):
    def __init__(self, hidden_size: int, dims: MLADims) -> None:
        super().__init__()
        idx = dims.indexer
        check(idx is not None, "index_topk", None, "set for an indexer (DeepSeek-V3.2 sparse MLA)")
        check(dims.q_lora_rank is not None, "q_lora_rank", None, "an integer: the indexer reads the q LoRA")
        self.num_heads, self.head_dim, self.rope_dim = idx.num_heads, idx.head_dim, dims.qk_rope_head_dim
        self.wq_b = nn.Linear(dims.q_lora_rank, idx.num_heads * idx.head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, idx.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(idx.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, idx.num_heads, bias=False)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                rotary: YarnRotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [T, hidden], q_resid [T, q_lora_rank] -> q [T, Hi, D], head weights [T, Hi] f32, keys [T, D]."""
        t, d = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, None]  # [T, 1, D]
        q = torch.cat((rotary.apply(q[..., :d], *rope, interleaved=False), q[..., d:]), dim=-1)
        k = torch.cat((rotary.apply(k[..., :d], *rope, interleaved=False), k[..., d:]), dim=-1)
        return q, self.head_weights(x), k[:, 0]

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """weights_proj(x) / sqrt(Hi) [T, Hi] float32: computed in float32 as HF does (it keeps this
        projection out of FP8 and in float32); a quantized checkpoint's projection computes itself."""
        proj = self.weights_proj
        if type(proj) is nn.Linear:
            out = nn.functional.linear(x.float(), proj.weight.float())
        else:
            out = proj(x).float()
        return out * self.num_heads**-0.5
