"""Compile the model-side fused kernels (workers/models/fused_ops.py, fused_moe.py) for a GPU
target, with or without a GPU, and report registers, stack (spills) and shared memory.

    python -m bench.kernel_report_fused [--arch 90] [--sass DIR]

The launch interception of bench/kernel_report.py, at DeepSeek-V2-Lite / GPT-OSS-20B / V3
decode shapes: the routing kernel with and without a graph bucket's real-row count, a padded
bucket's fused MoE (the down kernel's extra programs that zero the padding rows), the norm that
sums an MoE layer's deferred rows (k = 4, 6, 8, with and without the shared experts' row, with
the float32 copy for the router), silu-and-mul with torch's rounding (`round_act`: libdevice's
expf and IEEE division, which the CPU interpreter never compiles), and the MoE alignment that
adds the load counters. A kernel that does not compile for sm_90 fails here, not inside a
device call. Put the device's Triton first on the path to match it (bench/kernel_report.py says
how).
"""

from __future__ import annotations

import torch
import triton

from bench.kernel_report import compile_report
from meshserve.workers.models import fused_moe, fused_ops
from meshserve.workers.models.moe_routing import RoutingSpec
from meshserve.workers.models.routing_kernel import route_triton

BF16 = torch.bfloat16


def _launches():
    def norm(tokens: int, k: int, hidden: int, shared: bool, router_copy: bool):
        def run():
            parts = torch.zeros(tokens, k, hidden, dtype=BF16)
            extra = torch.zeros(tokens, hidden, dtype=BF16) if shared else None
            residual, weight = torch.zeros(tokens, hidden, dtype=BF16), torch.ones(hidden, dtype=BF16)
            float_out = torch.empty(tokens, hidden) if router_copy else None
            fused_ops._launch_norm(parts, residual, weight, 1e-6, False, deferred=fused_ops.DeferredSum(parts, extra),
                                   float_out=float_out)  # fmt: skip

        return run

    def act_and_mul(tokens: int, inter: int):
        def run():
            gate_up, out = torch.zeros(tokens, 2 * inter, dtype=BF16), torch.empty(tokens, inter, dtype=BF16)
            block = min(triton.next_power_of_2(inter), 1024)
            fused_ops._act_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
                gate_up, out, gate_up.stride(0), inter, ACT=0, ROUND_ACT=True, INTERPRETED=False, BLOCK=block,
                num_warps=4)  # fmt: skip

        return run

    def align(tokens: int, k: int, experts: int, block_m: int):
        def run():
            ids = torch.zeros(tokens * k, dtype=torch.int64)
            max_padded = triton.cdiv(tokens * k + min(experts, tokens * k) * (block_m - 1), block_m) * block_m
            fused_moe._align_with_kernel(ids, experts, block_m, max_padded, torch.zeros(experts, dtype=torch.int64))

        return run

    def route(tokens: int, spec: RoutingSpec, padded: bool):
        def run():
            real = torch.full((1,), tokens - 1, dtype=torch.int32) if padded else None
            route_triton(torch.zeros(tokens, spec.num_experts), spec, torch.zeros(spec.num_experts),
                         num_real_tokens=real)  # fmt: skip

        return run

    def moe_padded(tokens: int, k: int, experts: int, hidden: int, inter: int):
        def run():  # a graph bucket's MoE: the down kernel's extra programs zero the padding rows
            ew = fused_moe.ExpertWeights(w13=torch.zeros(experts, 2 * inter, hidden, dtype=BF16),
                                         w2=torch.zeros(experts, hidden, inter, dtype=BF16), b13=None, b2=None,
                                         activation=fused_moe.ExpertActivation(fused_moe.ACT_SILU))  # fmt: skip
            ids, real = torch.zeros(tokens, k, dtype=torch.int64), torch.full((1,), tokens - 1, dtype=torch.int32)
            fused_moe.fused_moe(torch.zeros(tokens, hidden, dtype=BF16), torch.zeros(tokens, k), ids, ew,
                                sum_rows=False, num_real_tokens=real)  # fmt: skip

        return run

    v3 = RoutingSpec(256, 8, scoring="sigmoid", group_by="top2_sum", num_groups=8, topk_groups=4,
                     norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    return [
        ("route v3 bs4 padded", route(4, v3, True)),
        ("route v3 bs4", route(4, v3, False)),
        ("moe v2-lite bs4 padded", moe_padded(4, 6, 64, 2048, 1408)),
        ("norm v2-lite k6+shared+router", norm(1, 6, 2048, True, True)),
        ("norm gpt-oss k4", norm(64, 4, 2880, False, False)),
        ("norm v3 k8+shared+router", norm(256, 8, 7168, True, True)),
        ("silu*up round_act 1408x2", act_and_mul(1, 2816)),
        ("silu*up round_act 10944", act_and_mul(64, 10944)),
        ("align k6 E64 +load", align(1, 6, 64, 16)),
        ("align k4 E32 +load", align(256, 4, 32, 64)),
    ]


if __name__ == "__main__":
    raise SystemExit(compile_report(_launches(), __doc__.splitlines()[0]))
