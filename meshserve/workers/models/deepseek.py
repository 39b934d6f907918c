"""DeepseekV2/V3/V32ForCausalLM: multi-head latent attention (V3.2: sparse, indexer top-k), MoE.

The same interface as transformer.CausalLM (packed [T, hidden] tokens, one ForwardContext per
step, `attention_specs`, `compute_logits`), and HF's parameter names, one checkpoint tensor
per parameter. Attention per token (DeepSeek-V2 paper, section 2.1):

    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x)      [H, nope + rope]
    c, k_pe      = kv_a_proj_with_mqa(x)                                      [rank], [rope]
                   (q_proj / q_a_proj and kv_a_proj_with_mqa: one stacked GEMM, q_kv_a_proj)
    c            = kv_a_layernorm(c)                 (cached with the rotated k_pe, one row per token)
    o            = MLA(q_nope, rope(q_pe); c, rope(k_pe); W_UK, W_UV from kv_b_proj)  [H, v]
    out          = o_proj(o)

The cache write and the attention go through the layer's MLAAttention (decode and prefill
backends chosen separately); this module never sees the latent layout or the kernels. On CUDA
one kernel rotates q's rope part and k_pe and normalises the latent (mla_rope.py), and the
residual adds run inside the norms (fused_ops.add_rms_norm: layers pass (output, residual)
pairs, as transformer.py). V3.2 layers also run the lightning indexer (deepseek_indexer.py) and
attend through a SparseMLAAttention to the top-k tokens it scores best.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshserve.attention.mla.backend import MLAWeights
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.spec import AttentionSpec
from meshserve.workers.models.arch import ModelArch
from meshserve.workers.models.decoder_only import DecoderOnlyLM
from meshserve.workers.models.deepseek_indexer import Indexer
from meshserve.workers.models.expert_layer import experts_graph_safe
from meshserve.workers.models.mla_rope import rotary_mla_qk
from meshserve.workers.models.moe import GatedMLP, MoE
from meshserve.workers.models.transformer import ForwardContext, LayerAttention, RMSNorm
from meshserve.workers.models.yarn_rope import YarnRotary


class MLAttention(nn.Module):
    """DeepSeek's attention. The two projections that read x, q's first one (q_proj, or q_a_proj
    with a q LoRA) and kv_a_proj_with_mqa, are one matrix, q_kv_a_proj [q_rows + rank + rope,
    hidden] (q's rows first: the loader stacks them, DeepseekForCausalLM.STACKED): one GEMM a
    layer instead of two, whose output q and the latent are views of (row stride = its width).

    Under tensor parallelism a rank's q_kv_a_proj holds its query heads' q_proj rows and the
    whole kv_a_proj_with_mqa (which every rank computes in full); with a q LoRA, q_a_proj is
    whole on every rank too: the stack is the same at any tp. `split()` goes back to the two
    HF linears where one matrix cannot hold the checkpoint (FP8 block scales that q's rows end
    inside, or FP8 on only one of them; a checkpoint without q LoRA but with attention biases:
    HF's q_proj has none); the loader then fills them by their own names.
    """

    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        ds = arch.deepseek
        dims = ds.mla
        self.layer_idx = layer_idx
        # num_heads: the query heads this module projects; attn_heads: the heads its attention
        # computes (more under DCP, where a rank attends for its whole DCP group: deepseek_parallel).
        self.num_heads = self.attn_heads = arch.num_heads
        self.dims = dims
        hidden, heads, bias = arch.hidden_size, arch.num_heads, ds.attention_bias
        q_out = heads * dims.qk_head_dim
        self.q_kv_a_proj: nn.Module | None = None
        if dims.q_lora_rank is not None:
            self.q_kv_a_proj = nn.Linear(hidden, dims.q_lora_rank + dims.latent_size, bias=bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, 1e-6)  # HF's default eps for these norms
            self.q_b_proj = nn.Linear(dims.q_lora_rank, q_out, bias=False)
        elif stacks_q_kv_a(arch):
            self.q_kv_a_proj = nn.Linear(hidden, q_out + dims.latent_size, bias=False)
        else:  # HF's q_proj has no bias, its kv_a_proj_with_mqa one: two linears
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, dims.latent_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(dims.kv_lora_rank, heads * (dims.qk_nope_head_dim + dims.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * dims.v_head_dim, hidden, bias=bias)
        # DeepSeek-V3.2: the lightning indexer picks the tokens each query attends to (sparse MLA).
        self.indexer = Indexer(hidden, dims) if dims.indexer is not None else None

    @property
    def q_rows(self) -> int:
        """Rows of q's part of q_kv_a_proj: q_lora_rank, or this module's heads x qk_head_dim."""
        dims = self.dims
        return dims.q_lora_rank if dims.q_lora_rank is not None else self.num_heads * dims.qk_head_dim

    @property
    def q_name(self) -> str:
        """HF's name of q's first projection (q_kv_a_proj's first part)."""
        return "q_proj" if self.dims.q_lora_rank is None else "q_a_proj"

    def split(self) -> None:
        """q's first projection (q_proj / q_a_proj) and kv_a_proj_with_mqa as separate (new,
        uninitialised) linears, in the stacked one's dtype and device."""
        fused = self.q_kv_a_proj
        hidden, like = fused.in_features, dict(dtype=fused.weight.dtype, device=fused.weight.device)
        bias = fused.bias is not None
        setattr(self, self.q_name, nn.Linear(hidden, self.q_rows, bias=bias, **like))
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.dims.latent_size, bias=bias, **like)
        self.q_kv_a_proj = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotary: YarnRotary,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        T, H, dims = x.shape[0], self.num_heads, self.dims
        r = dims.kv_lora_rank
        if self.q_kv_a_proj is not None:
            both = self.q_kv_a_proj(x)  # [T, q_rows + rank + rope]: views, row stride q_rows + rank + rope
            q_part, compressed = both[:, : self.q_rows], both[:, self.q_rows :]
        else:
            q_part, compressed = getattr(self, self.q_name)(x), self.kv_a_proj_with_mqa(x)
        if dims.q_lora_rank is None:
            q, q_resid = q_part, None
        else:
            q_resid = self.q_a_layernorm(q_part)
            q = self.q_b_proj(q_resid)
        q = q.view(T, H, dims.qk_head_dim)
        # q's rope part and k_pe [T, rope] (shared by every head) rotated, and the latent [T, rank]
        # normalised (kv_a_layernorm) from compressed [T, rank + rope]: one kernel on CUDA.
        norm = self.kv_a_layernorm
        q, k_pe, latent = rotary_mla_qk(q, compressed, *rope, norm.weight, kv_lora_rank=r,
                                        interleaved=rotary.rope.interleaved, eps=norm.eps)  # fmt: skip
        layer = ctx.layers[self.layer_idx]
        if self.indexer is None:
            o = self.attend(q, latent, k_pe, layer)  # [T, H, v]
        else:
            o = self.attend_sparse(q, latent, k_pe, self.indexer(x, q_resid, rope, rotary), layer)
        return self.o_proj(o.reshape(T, H * dims.v_head_dim))

    def attend(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
        """Write the new tokens' latent rows, attend: q [T, H, nope + rope] -> o [T, H, v]."""
        layer.backend.write_kv(latent, k_pe, layer.kv_cache, layer.plan)
        weights = MLAWeights.from_kv_b_proj(self.kv_b_proj.weight, self.attn_heads, self.dims)
        return layer.backend.forward(q, layer.kv_cache, layer.plan, weights)

    def attend_sparse(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      layer: LayerAttention) -> torch.Tensor:  # fmt: skip
        """Sparse MLA: write the latent rows and index keys, choose each token's top-k rows, attend to them."""
        layer.backend.write_kv(latent, k_pe, layer.kv_cache, layer.plan)
        rows = layer.backend.index(*index, layer.kv_cache, layer.plan)  # [T, k] this rank's chosen rows
        weights = MLAWeights.from_kv_b_proj(self.kv_b_proj.weight, self.attn_heads, self.dims)
        return layer.backend.forward(q, layer.kv_cache, layer.plan, weights, rows=rows)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        moe = arch.deepseek.moe
        self.self_attn = MLAttention(arch, layer_idx)
        if layer_idx < moe.first_k_dense_replace:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)
        else:
            self.mlp = MoE(arch.hidden_size, moe)
            self.mlp.sum_in_norm = True  # its output goes straight to the next add_and_norm
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                rotary: YarnRotary, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x: the previous layer's output and `residual` the stream it is still to be added to
        (layer 0: the embeddings and None). Returns (output, residual) in the same sense, as
        transformer.DecoderLayer: each residual add runs inside the next norm (fused_ops)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, rope, rotary, ctx)
        if isinstance(self.mlp, MoE):  # the router computes in float32: the norm writes that copy too
            h, residual, h_float = self.post_attention_layernorm.add_and_norm_float(attn, residual)
            return self.mlp(h, h_float, num_real_tokens=ctx.num_real_tokens), residual
        h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self.mlp(h), residual


class DeepseekBody(nn.Module):
    """HF's `model.` prefix."""

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = YarnRotary(arch.deepseek.rope, arch.deepseek.mla.qk_rope_head_dim, max_positions)


class DeepseekForCausalLM(DecoderOnlyLM, nn.Module):
    """DeepSeek-V2/V3 over a packed batch of new tokens (a contract.GenerativeModel)."""

    # The MLPs' gate and up (dense, shared and routed experts) load into one gate_up_proj each;
    # an instance adds MLA's q_kv_a_proj parts (q_proj or q_a_proj, then kv_a_proj_with_mqa):
    # which q projection is stacked depends on the checkpoint (stacked_modules).
    STACKED: dict[str, tuple[str, int]] = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, arch: ModelArch, *, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.STACKED = stacked_modules(arch)
        self.model = DeepseekBody(arch, max_positions or arch.max_position_embeddings)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether forward never waits on the device: when every MoE layer runs fused (CUDA)."""
        return experts_graph_safe(self)

    def attention_specs(self) -> list[AttentionSpec]:
        ds = self.arch.deepseek
        spec = mla_spec(self.arch.num_heads, ds.mla, scale=ds.softmax_scale)  # the whole model's heads
        return [spec] * self.arch.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns final-normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary
        rope = rotary(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, rotary, ctx)
        return self.model.norm(x) if residual is None else self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()


def stacks_q_kv_a(arch: ModelArch) -> bool:
    """Whether MLA's q projection and kv_a_proj_with_mqa are built as one q_kv_a_proj: always
    with a q LoRA (q_a_proj and kv_a_proj_with_mqa both carry attention_bias), and without one
    unless attention_bias (HF's q_proj has no bias while kv_a_proj_with_mqa has)."""
    return arch.deepseek.mla.q_lora_rank is not None or not arch.deepseek.attention_bias


def stacked_modules(arch: ModelArch) -> dict[str, tuple[str, int]]:
    """The checkpoint modules the loader stacks for `arch` (DeepseekForCausalLM.STACKED and MLA's)."""
    out = dict(DeepseekForCausalLM.STACKED)
    if stacks_q_kv_a(arch):
        q = "q_proj" if arch.deepseek.mla.q_lora_rank is None else "q_a_proj"
        out |= {q: ("q_kv_a_proj", 0), "kv_a_proj_with_mqa": ("q_kv_a_proj", 1)}
    return out


def split_unstackable_mla(model: nn.Module, block_rows: int | None, quantized: Callable[[str], bool]) -> list[str]:
    """Split the q_kv_a_proj of every MLAttention of the (meta-device) `model` that cannot hold
    the checkpoint: FP8 block scales (blocks of `block_rows` rows; None: none) that q's rows end
    inside (one block scale cannot cover q's last rows and kv_a's first; kv_a's rows may end
    mid-block: its part is the last), or weights of which `quantized(module name)` holds for one
    only (one matrix has one format). Returns the modules split."""
    split = []
    for name, module in model.named_modules():
        if not isinstance(module, MLAttention) or module.q_kv_a_proj is None:
            continue
        q_fp8, kv_fp8 = (quantized(f"{name}.{part}") for part in (module.q_name, "kv_a_proj_with_mqa"))
        if q_fp8 != kv_fp8 or (q_fp8 and block_rows is not None and module.q_rows % block_rows):
            module.split()
            split.append(name)
    return split
