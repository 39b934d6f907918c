"""One decoder-only transformer for every supported architecture (differences come from ModelArch).

Plain torch, gpt-fast style: no tensor-parallel or quantisation code here (those are
transforms applied to the built model). Tokens are packed: activations are [T, hidden] for the
T new tokens of all sequences in a step. Attention goes through the backend handed in with
the step's `ForwardContext`; no code here knows which backend that is.

Layers pass on (output, residual stream) pairs, as vLLM does, so that each residual add joins
the norm after it: these, the MLP activation and the rotary embedding with the K/V write run
as fused kernels (fused_ops): Triton on CUDA, meshserve's compiled ops on a CPU in float32
(the torch ops where those are not built).

Parameter names follow HF checkpoints, except that q/k/v and gate/up are fused into one matrix
each (`qkv_proj`, `gate_up_proj`); the loader stacks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

import meshserve.workers.models.fused_ops as fused
from meshserve.attention.backend import AttentionBackend, KVCache, LayerParams
from meshserve.attention.spec import AttentionSpec
from meshserve.errors import check
from meshserve.workers.models.arch import ModelArch
from meshserve.workers.models.decoder_only import DecoderOnlyLM
from meshserve.workers.models.expert_layer import ExpertLayer, experts_graph_safe
from meshserve.workers.models.rope import RotaryEmbedding, apply_rotary

_NO_LAYER_PARAMS = LayerParams()  # (frozen: one shared instance, not one per layer per step)


@dataclass
class LayerAttention:
    """What one layer needs to attend: its backend, the backend's plan for this step, its cache,
    and where the new tokens' K/V go in it.

    slot_mapping: [T] int64 cache slot of each new token (-1: do not write); from the block
    tables of the layer's KV group (layers of a hybrid model's groups have different ones).
    Both None for a layer without a cache (an encoder's self-attention).
    """

    backend: AttentionBackend
    plan: object
    kv_cache: KVCache | None
    slot_mapping: torch.Tensor | None


@dataclass
class EncoderStep:
    """The encoder inputs of the sequences whose first decoder token this step computes.

    input_ids, positions: [Te] int64, packed like the decoder's tokens (positions from 0 per input)
    backend, plan: the ENCODER_ONLY backend and its plan over the packed inputs
    slot_mapping: [Te] int64 cache slot of each encoder token in the cross-attention layers'
                  caches (through the request's encoder block table)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    backend: AttentionBackend
    plan: object
    slot_mapping: torch.Tensor


@dataclass
class ForwardContext:
    """One step's attention state, passed explicitly to every layer.

    layers: one LayerAttention per cached attention layer (the model's attention_specs order).
    encoder: encoder-decoder models only: the encoder inputs this step runs (None: none).
    num_real_tokens: [1] int32 or int64 on the device: how many leading rows of the step are
        real tokens; the rows at and after it pad a CUDA-graph bucket (decode_graphs.py,
        piecewise_graphs.py write it before every replay). MoE layers route those rows to no
        expert (nothing computed, nothing counted in expert_load). None: every row is real.
    """

    layers: Sequence[LayerAttention]
    encoder: EncoderStep | None = None
    num_real_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.num_real_tokens
        if n is not None:
            check(n.numel() == 1 and n.dtype in (torch.int32, torch.int64), "num_real_tokens",
                  f"{tuple(n.shape)} {n.dtype}", "a one-element int32/int64 tensor or None")  # fmt: skip


class RMSNorm(nn.Module):
    """unit_offset: the scale is 1 + weight (Gemma checkpoints store the offset from one)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32; with unit_offset, as Gemma, normalised and scaled in float32.
        return fused.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)

    def add_and_norm(self, x: torch.Tensor | fused.DeferredSum,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(norm(x + residual), x + residual); the sum is in the activation dtype. x may be an MoE
        layer's unsummed output (fused_ops.DeferredSum), summed first."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps, unit_offset=self.unit_offset)

    def add_and_norm_float(self, x: torch.Tensor | fused.DeferredSum,
                           residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """add_and_norm's pair and the normed rows in float32 too (for DeepSeek's router; plain
        norms only), stored by the same kernel on CUDA."""
        check(not self.unit_offset, "unit_offset", True, "False for add_and_norm_float")
        return fused.add_rms_norm_float(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, arch.norm_unit_offset) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, arch.norm_unit_offset) if arch.qk_norm else None
        # GPT-OSS: one learned logit per query head joins the softmax denominator.
        self.sinks = nn.Parameter(torch.empty(arch.num_heads), requires_grad=False) if arch.attn_sinks else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        layer = ctx.layers[self.layer_idx]
        if self.q_norm is None and layer.backend.fused_kv_write and fused.fuses_rotary_write(qkv, layer.kv_cache):
            # One kernel (Triton on CUDA, C++ on a CPU) rotates q and k and stores k and v as the
            # backend's write_kv would.
            q, k, v = fused.rotary_qk_write_kv(qkv, *rope, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                                               kv_cache=layer.kv_cache, slot_mapping=layer.slot_mapping)
        else:
            q, k, v = self._rotate(qkv, rope)
            layer.backend.write_kv(k, v, layer.kv_cache, layer.slot_mapping, plan=layer.plan)
        params = _NO_LAYER_PARAMS if self.sinks is None else LayerParams(sinks=self.sinks)
        o = layer.backend.forward(q, k, v, layer.kv_cache, layer.plan, layer=params)  # [T, H, D]
        return self.o_proj(o.reshape(T, H * D))

    def _rotate(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] normed (q/k norms) and rotated; v [T, Hkv, D], a view of qkv."""
        T, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = H * D, Hkv * D
        if self.q_norm is None:
            qk = qkv[:, : q_size + kv_size].view(T, H + Hkv, D)  # q and k heads, rotated together
        else:
            q = self.q_norm(qkv[:, :q_size].view(T, H, D))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(T, Hkv, D))
            qk = torch.cat((q, k), dim=1)
        q, k = apply_rotary(qk, *rope).split([H, Hkv], dim=1)
        return q, k, qkv[:, q_size + kv_size :].view(T, Hkv, D)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.hidden_act = arch.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate, then up
        return self.down_proj(fused.act_and_mul(gate_up, self.hidden_act))  # act(gate) * up: [T, I]


def _mlp(arch: ModelArch) -> nn.Module:
    if arch.experts is not None:
        from meshserve.workers.models.gptoss_moe import SwigluMoE

        return SwigluMoE(arch.hidden_size, arch.intermediate_size, arch.experts)
    return MLP(arch)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. With sandwich norms (Gemma2) the attention and MLP outputs are
    normed too before the residual add: HF names them post_attention_layernorm (attention
    output), pre_feedforward_layernorm and post_feedforward_layernorm."""

    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = _mlp(arch)
        if arch.experts is not None and not arch.sandwich_norms:
            self.mlp.sum_in_norm = True  # its output goes straight to the next add_and_norm

        def norm() -> RMSNorm:
            return RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output and `residual` the stream it is still to be added to
        (layer 0: the embeddings and None). Returns (output, residual) in the same sense; the
        next layer's input norm, or the final norm, adds them as it normalises."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, rope, ctx)
        if self.sandwich:  # the attention output is normed before it joins the stream
            h, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn), residual)
            return self.post_feedforward_layernorm(self._feed_forward(h, ctx)), residual
        h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        return self._feed_forward(h, ctx), residual

    def _feed_forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | fused.DeferredSum:
        if ctx.num_real_tokens is not None and isinstance(self.mlp, ExpertLayer):  # padding rows: no experts
            return self.mlp(h, num_real_tokens=ctx.num_real_tokens)
        return self.mlp(h)


class DecoderBody(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_unit_offset)
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions)
        # Gemma3: sliding-window layers rotate with their own (local) base.
        self.local_rotary = (RotaryEmbedding(arch.local_rope, arch.head_dim, max_positions)
                             if arch.local_rope is not None else None)


# Checkpoint module -> (fused model module, index of its part along dim 0).
STACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(DecoderOnlyLM, nn.Module):
    """Decoder-only language model over a packed batch of new tokens (a contract.GenerativeModel)."""

    STACKED = STACKED

    def __init__(self, arch: ModelArch, *, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.model = DecoderBody(arch, max_positions or arch.max_position_embeddings)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether forward never waits on the device (a CUDA graph can hold it): MoE layers only
        when their experts run fused (the torch loop reads expert ids on the host)."""
        return experts_graph_safe(self)

    def attention_specs(self) -> list[AttentionSpec]:
        """One spec per layer; layers with equal specs can share a backend instance."""
        a = self.arch
        return [
            AttentionSpec(num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_size=a.head_dim,
                          sliding_window=window, scale=a.attn_scale, logits_soft_cap=a.attn_soft_cap,
                          has_sinks=a.attn_sinks)
            for window in a.layer_windows
        ]

    def finish_loading(self, device: torch.device | str) -> None:
        super().finish_loading(device)
        if self.model.local_rotary is not None:
            self.model.local_rotary.reset_tables(device)
        for layer in self.model.layers:
            sinks = layer.self_attn.sinks
            if sinks is not None and sinks.dtype != torch.float32:
                # Every backend reads the sink logits in float32: held so (exactly the loaded values),
                # not cast by a kernel per layer per step.
                layer.self_attn.sinks = nn.Parameter(sinks.detach().float(), requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64. Returns final-normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.arch.embed_scale is not None:  # Gemma: the scale is rounded to the activation dtype first
            # A host 0-dim tensor, as HF does: a launch argument, no copy to the device (graph-safe).
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        rope = self.model.rotary(positions, x.dtype)  # computed once, used by every layer
        local = rope if self.model.local_rotary is None else self.model.local_rotary(positions, x.dtype)
        residual = None
        for layer, window in zip(self.model.layers, self.arch.layer_windows):
            x, residual = layer(x, residual, rope if window is None else local, ctx)
        return self.model.norm(x) if residual is None else self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (soft-capped when the arch says so)."""
        logits = self.lm_head(hidden)
        logits = logits if logits.dtype == torch.float32 else logits.float()
        cap = self.arch.final_soft_cap
        return logits if cap is None else cap * torch.tanh(logits / cap)
