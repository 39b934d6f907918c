"""Compile the GEMM kernels (workers/quant: small-M streaming, the split-K GEMV on FP8 and bf16 weights,
activation quantizers, block GEMM)
for a GPU target on a machine without one, and report registers, stack (spills) and shared memory.

    python -m bench.kernel_report_gemm [--arch 90] [--sass DIR]

The same launch interception as bench/kernel_report.py (the attention kernels): each launch of
the real host code, on CPU tensors, is compiled for sm_<arch> instead of run. Catches compile
errors, spills and shared-memory overflows at the Llama-3-8B shapes before any GPU time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from bench.kernel_report import compile_report

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "qkv_tp8": (768, 4096), "kv_a_mla": (576, 7168)}


def launches() -> Iterator[tuple[str, Callable[[], object]]]:
    """Every kernel variant the serving path can launch for these shapes (weights empty: nothing runs)."""
    from meshserve.workers.quant.fp8_triton import block_gemm, quantize_groups, quantize_rows
    from meshserve.workers.quant.gemv import CONFIGS, weight_gemv
    from meshserve.workers.quant.small_m import plan_stream, stream_linear

    fp8 = torch.float8_e4m3fn
    for name, (n, k) in SHAPES.items():
        for act in (torch.bfloat16, torch.float16):
            for m in (1, 16):
                x = torch.empty(m, k, dtype=act)
                formats = {"dense": (torch.empty(n, k, dtype=act), None, None),
                           "fp8_block": (torch.empty(n, k, dtype=fp8), torch.empty(-(-n // 128), -(-k // 128)),
                                         (128, 128)),
                           "fp8_channel": (torch.empty(n, k, dtype=fp8), torch.empty(n), None)}
                for fmt, (w, s, block) in formats.items():
                    plan = plan_stream(n, k, weight_bytes=w.element_size(), scale_k=block and block[1], num_sms=132)
                    yield f"{name} M={m} {fmt} {str(act)[6:]} {plan}", lambda x=x, w=w, s=s, b=block, p=plan: (
                        stream_linear(x, w, s, b, plan=p))
        for i, cfg in enumerate(CONFIGS):
            x, w = torch.empty(1, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=fp8)
            for fmt, (s, block) in {"fp8_block": (torch.empty(-(-n // 128), -(-k // 128)), (128, 128)),
                                    "fp8_channel": (torch.empty(n), None)}.items():
                yield f"{name} gemv[{i}] {fmt} {cfg}", lambda x=x, w=w, s=s, b=block, c=cfg: (
                    weight_gemv(x, w, s, b, config=c, num_sms=132))
            wd, xd = torch.empty(n, k, dtype=torch.bfloat16), torch.empty(1 if cfg.cores else 16, k,
                                                                          dtype=torch.bfloat16)
            yield f"{name} gemv[{i}] bf16 {cfg}", lambda x=xd, w=wd, c=cfg: weight_gemv(x, w, config=c, num_sms=132)
        x = torch.empty(4096, k, dtype=torch.bfloat16)
        yield f"{name} quantize_rows", lambda x=x: quantize_rows(x)
        yield f"{name} quantize_groups", lambda x=x: quantize_groups(x, 128)
        xq, xs = torch.empty(4096, k, dtype=fp8), torch.empty(4096, -(-k // 128))
        wq, ws = torch.empty(n, k, dtype=fp8), torch.empty(-(-n // 128), -(-k // 128))
        yield f"{name} block_gemm M=4096", lambda a=(xq, xs, wq, ws): block_gemm(*a, (128, 128), torch.bfloat16)


def main() -> int:
    return compile_report(launches(), __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
