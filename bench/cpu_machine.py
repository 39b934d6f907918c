"""Which CPU a CPU table was taken on: the model as /proc/cpuinfo names it and a measured
one-thread float32 GEMM rate.

The development VM's host changes between sessions while its name stays "AMD EPYC": on
2026-12-02 one thread ran oneDNN's float32 GEMM at about 200 GFLOP/s, on 2026-12-05 at about 110
(family 25, model 17: one 512-bit FMA per cycle), which halved meshserve's CPU decode against
HF transformers' MKL path (docs/performance.md, "CPU decode against 4b931ca"). Absolute CPU
figures compare only between runs with the same fingerprint; bench/e2e.py --device cpu records it.

    python -m bench.cpu_machine
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

ROWS, IN, OUT = 1024, 256, 1536  # the demo model's gate_up shape at a prefill-sized batch


def cpu_identity() -> str:
    """'<model name>, family F model M stepping S' of the first core ('unknown' off Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    fields = {}
    for line in lines:
        if not line.strip():
            break  # the first core only
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return (f"{fields.get('model name', '?')}, family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')} stepping {fields.get('stepping', '?')}")


def gemm_gflops(iters: int = 15) -> float:
    """One-thread float32 GEMM rate (oneDNN where torch has it, else torch.mm), timed in this
    thread's CPU seconds so that other jobs on the machine barely move it; median of `iters`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(ROWS, IN, generator=g), torch.randn(IN, OUT, generator=g)
        if torch.backends.mkldnn.is_available():
            def op():
                return torch.ops.mkldnn._linear_pointwise(x, w.t(), None, "none", [], "")
        else:
            def op():
                return torch.mm(x, w)
        for _ in range(3):
            op()
        times = []
        for _ in range(iters):
            t0 = time.thread_time()
            op()
            times.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    times.sort()
    return 2 * ROWS * IN * OUT / times[len(times) // 2] / 1e9


def fingerprint() -> dict:
    return {"cpu": cpu_identity(), "gemm_gflops_1thread": round(gemm_gflops(), 1)}


def main() -> None:
    fp = fingerprint()
    print(f"{fp['cpu']}; one-thread float32 GEMM {ROWS}x{IN}x{OUT}: {fp['gemm_gflops_1thread']:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
