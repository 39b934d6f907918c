"""DeepSeek's mixture of experts: grouped top-k routing, routed experts, always-on shared experts.

Plain torch, written to be read: the router scores every expert, keeps the best `topk_groups`
groups of experts, picks `top_k` experts among them, and weighs their outputs; the shared
experts see every token. Each routed expert runs once per step on the tokens sent to it.
Module and parameter names are HF's, so checkpoints load one tensor per parameter.

`run_moe` is where both MoE families (this one, gptoss_moe.py) choose how their experts run:
the readable loop below (CPU, the oracle) or, once `finish_loading` packed them on CUDA, the
fused Triton kernels (fused_moe.py); under expert parallelism through the all-to-all of
expert_parallel.py. It also counts the rows each local expert receives (`expert_load`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import meshserve.workers.models.fused_ops as fused_ops
from meshserve.errors import check
from meshserve.workers.models.deepseek_arch import MoEConfig
from meshserve.workers.models.expert_layer import ExpertLayer
from meshserve.workers.models.fused_moe import (
    ACT_SILU,
    ExpertActivation,
    ExpertWeights,
    fused_moe,
)
from meshserve.workers.models.moe_routing import RoutingSpec, route_torch
from meshserve.workers.models.routing_kernel import route_triton

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def combine_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, run_expert: ExpertFn, *,
                    num_experts: int | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, grouped per expert.

    x [T, hidden]; weights [T, k]; ids [T, k] int64; run_expert(e, x_e [n, hidden]) -> [n, hidden].
    Each chosen expert runs once on all its tokens, in ascending expert order (the order HF
    accumulates in, so float sums match it). num_experts given: ids outside [0, num_experts)
    are dropped (held by another rank). Returns [T, hidden] in x's dtype.
    """
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        if num_experts is not None and not 0 <= expert < num_experts:
            continue
        token, slot = torch.where(ids == expert)
        y = run_expert(expert, x[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def select_experts(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None, *,
                   use_triton: bool | None = None, num_real_tokens: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Router logits [T, E] -> (weights, ids) [T, k] as moe_routing.route_torch computes them; on
    CUDA (use_triton None) in one Triton launch (routing_kernel.py). num_real_tokens ([1] int on
    the device; ForwardContext's): the rows at and after it get DROPPED ids and weight 0."""
    check(logits.dim() == 2 and logits.shape[1] == spec.num_experts, "logits", tuple(logits.shape),
          f"[T, {spec.num_experts}]")  # fmt: skip
    if use_triton if use_triton is not None else logits.is_cuda:
        return route_triton(logits, spec, bias, num_real_tokens=num_real_tokens)
    return route_torch(logits, spec, bias, num_real_tokens=num_real_tokens)


def local_experts(module: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  run_expert: ExpertFn | None, *, may_drop: bool = False, sum_rows: bool = True,
                  num_real_tokens: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The experts this rank holds on x [T, hidden] routed by (weights, ids) [T, k], fused when
    packed; counts each expert's rows into module.expert_load. ids past the local experts
    (may_drop) contribute 0. sum_rows False (fused only): the weighted rows [T, k, hidden].
    num_real_tokens: the rows at and after it are padding, routed to DROPPED ids: their
    output rows are 0 (the fused down kernel writes them; the loop path never touches them)."""
    num = module.expert_load.numel()
    fused: ExpertWeights | None = module.fused
    if fused is not None:
        return fused_moe(x, weights, ids, fused, may_drop=may_drop, expert_load=module.expert_load,
                         sum_rows=sum_rows, num_real_tokens=num_real_tokens)  # fmt: skip
    flat = ids.reshape(-1)
    bucket = torch.where((flat >= 0) & (flat < num), flat, num)
    module.expert_load += torch.zeros(num + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, bucket, torch.ones_like(bucket))[:num]
    return combine_experts(x, weights, ids, run_expert, num_experts=num)


def run_moe(module: ExpertLayer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            run_expert: ExpertFn | None, shared: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
            num_real_tokens: torch.Tensor | None = None) -> torch.Tensor | fused_ops.DeferredSum:  # fmt: skip
    """Routed experts (+ shared experts) of x [T, hidden]; weights, ids [T, k] from the router.

    num_real_tokens (ForwardContext's): the rows at and after it pad a CUDA-graph bucket; the
    router gave them DROPPED ids, so no expert runs or counts them and their routed output is 0
    (the shared experts still see them: a dense GEMM over the bucket costs the same).
    Under expert parallelism DROPPED rows are not dispatched to any rank.

    Under expert parallelism (module.expert_shard set) the result holds only this rank's share
    of the tokens, zeros elsewhere: the layer's all-reduce completes it. Fused experts of a layer
    whose output goes straight to the next add_and_norm (module.sum_in_norm) return a
    DeferredSum: the weighted rows and the shared experts' output, summed inside that norm.
    """
    shard = module.expert_shard
    if shard is not None:
        from meshserve.workers.models.expert_parallel import dispatch_combine

        def run_local(xs: torch.Tensor, ws: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
            return local_experts(module, xs, ws, ls, run_expert, may_drop=True)

        return dispatch_combine(x, weights, ids, shard, run_local, shared)
    if module.sum_in_norm and module.fused is not None:
        rows = local_experts(module, x, weights, ids, run_expert, sum_rows=False,
                             num_real_tokens=num_real_tokens)  # [T, k, hidden]  # fmt: skip
        return fused_ops.DeferredSum(rows, None if shared is None else shared(x))
    out = local_experts(module, x, weights, ids, run_expert, num_real_tokens=num_real_tokens)
    return out if shared is None else out + shared(x)


def _plain(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """An expert linear's weight as the fused kernels read it: FP8 experts (quant Fp8Linear)
    dequantized to the model dtype, the interim path until the kernels read FP8 with its scales."""
    dequantized = getattr(linear, "dequantized", None)
    return linear.weight if dequantized is None else dequantized(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense layers, each routed expert and the shared experts.

    gate and up are one matrix, gate_up_proj [2I, hidden] (gate rows, then up: the loader stacks
    HF's gate_proj and up_proj, DeepseekForCausalLM.STACKED), and silu(gate) * up one kernel on
    CUDA (fused_ops.act_and_mul with round_act: bit for bit F.silu(gate) * up). `split()` goes
    back to two matrices where a fused one cannot hold the checkpoint's FP8 block scales.
    """

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate
        self.gate_up_proj: nn.Module | None = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def split(self) -> None:
        """gate_proj and up_proj [I, hidden] as separate (new, uninitialised) linears, in the
        fused one's dtype and device: for FP8 block scales whose blocks I does not fill."""
        fused = self.gate_up_proj
        hidden, like = fused.in_features, dict(dtype=fused.weight.dtype, device=fused.weight.device)
        self.gate_proj = nn.Linear(hidden, self.intermediate_size, bias=False, **like)
        self.up_proj = nn.Linear(hidden, self.intermediate_size, bias=False, **like)
        self.gate_up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(fused_ops.act_and_mul(self.gate_up_proj(x), "silu", round_act=True))

    def gate_up_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[2I, hidden]: gate rows, then up, as the fused kernels read them (FP8 dequantized)."""
        if self.gate_up_proj is not None:
            return _plain(self.gate_up_proj, dtype)
        return torch.cat((_plain(self.gate_proj, dtype), _plain(self.up_proj, dtype)))


def split_unaligned_mlps(model: nn.Module, block_rows: int) -> list[str]:
    """Split the fused gate_up of every GatedMLP of the (meta-device) `model` whose I rows per
    part are not a multiple of block_rows, the FP8 scale blocks' rows: one block scale cannot
    cover the end of gate and the start of up. Returns the modules split."""
    split = []
    for name, module in model.named_modules():
        if isinstance(module, GatedMLP) and module.gate_up_proj is not None and module.intermediate_size % block_rows:
            module.split()
            split.append(name)
    return split


class Router(nn.Module):
    """Chooses top_k experts per token and their weights.

    weight: [E, hidden] (kept float32 when the model is: HF scores in float32)
    e_score_correction_bias: [E] (V3) added to the scores to choose experts, not to weigh them
    """

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.spec = RoutingSpec(
            num_experts=moe.num_experts, top_k=moe.top_k, scoring=moe.scoring, group_by=moe.group_by,
            num_groups=moe.num_groups, topk_groups=moe.topk_groups, norm_topk_prob=moe.norm_topk_prob,
            routed_scaling_factor=moe.routed_scaling_factor)  # fmt: skip
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts), requires_grad=False) if moe.correction_bias else None
        )

    def hold_float32(self) -> None:
        """Keep weight and bias in float32 (exactly their loaded values), as forward reads them:
        no cast kernel per step (the fused path calls this once the experts are packed)."""
        self.weight = nn.Parameter(self.weight.detach().float(), requires_grad=False)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = nn.Parameter(self.e_score_correction_bias.detach().float(),
                                                        requires_grad=False)  # fmt: skip

    def forward(self, x: torch.Tensor, x_float: torch.Tensor | None = None, *,
                num_real_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k] int64); the
        routing itself is moe_routing's (one Triton launch on CUDA). x_float: x.float() when
        the caller has it already (the norm before writes it: no cast launch). Rows at and
        after num_real_tokens (padding) get DROPPED ids."""
        bias = self.e_score_correction_bias
        return select_experts(F.linear(x.float() if x_float is None else x_float, self.weight.float()), self.spec,
                              None if bias is None else bias.float(), num_real_tokens=num_real_tokens)  # fmt: skip


class MoE(ExpertLayer):
    """Routed experts (weighted by the router) plus shared experts (every token)."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__(moe.num_experts)
        self.gate = Router(hidden, moe)
        self.experts: nn.ModuleList | None = nn.ModuleList(
            GatedMLP(hidden, moe.moe_intermediate_size) for _ in range(moe.num_experts))
        self.shared_experts = (
            GatedMLP(hidden, moe.moe_intermediate_size * moe.num_shared_experts) if moe.num_shared_experts else None
        )

    def pack_experts(self) -> None:
        """Switch to the fused kernels: the experts move to their layout; the modules are freed."""
        experts, dtype = self.experts, self.gate.weight.dtype
        self.fused = ExpertWeights(
            w13=torch.stack([e.gate_up_weight(dtype) for e in experts]),
            w2=torch.stack([_plain(e.down_proj, dtype) for e in experts]), b13=None, b2=None,
            activation=ExpertActivation(ACT_SILU))  # fmt: skip
        self.experts = None
        self.gate.hold_float32()

    def forward(self, x: torch.Tensor, x_float: torch.Tensor | None = None, *,
                num_real_tokens: torch.Tensor | None = None) -> torch.Tensor | fused_ops.DeferredSum:  # fmt: skip
        """x [T, hidden] -> [T, hidden] (or unsummed, for the next norm: run_moe); x_float: x in
        float32 (exactly x.float()) for the router, when the caller has it; num_real_tokens:
        ForwardContext's (padding rows run no routed expert)."""
        weights, ids = self.gate(x, x_float, num_real_tokens=num_real_tokens)  # [T, k] each
        experts = self.experts
        return run_moe(self, x, weights, ids, None if experts is None else (lambda e, xe: experts[e](xe)),
                       self.shared_experts, num_real_tokens=num_real_tokens)  # fmt: skip
