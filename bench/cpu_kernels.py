"""Microbenchmarks behind CPU_SDPA's paged decode kernel and the CPU linears' oneDNN threshold
(docs/performance.md, seventh session): one thread, median microseconds per call.

    python -m bench.cpu_kernels                 # both tables
    python -m bench.cpu_kernels --only linear   # MKL torch.mm vs oneDNN per demo shape and row count
    python -m bench.cpu_kernels --only decode   # kernel vs the torch decode paths, warm and cold caches

"cold" cycles through 8 caches of the group's size (more than a 32 MiB L3 at 64 x 128 keys), as a
step over six layers does. Prints the CPU model: the linear table depends on it (MKL's sgemm on
AMD EPYC ran at about half of oneDNN's rate).
"""

from __future__ import annotations

import argparse
import functools
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (512, 256), "gate_up": (1536, 256), "down": (256, 768), "lm_head": (4096, 256)}


def _median_us(fns, n: int) -> float:
    for f in fns:
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        for f in fns:
            f()
        times.append((time.perf_counter() - t) / len(fns))
    return sorted(times)[len(times) // 2] * 1e6


def linear_table(rows=(1, 4, 8, 16, 64, 1024)) -> None:
    from meshserve.workers.cpu_weights import onednn_available, onednn_linear

    print(f"rows | {' | '.join(SHAPES)}   (us, MKL torch.mm on [in, out] / oneDNN on the same storage)")
    for m in rows:
        cells = []
        for out_f, in_f in SHAPES.values():
            w_t = torch.randn(in_f, out_f)
            x = torch.randn(m, in_f)
            n = 60 if m <= 64 else 8
            mkl = _median_us([functools.partial(torch.mm, x, w_t)], n)
            dnnl = (_median_us([functools.partial(onednn_linear, x, w_t.t(), None)], n) if onednn_available()
                    else float("nan"))
            cells.append(f"{mkl:.0f} / {dnnl:.0f}")
        print(f"{m} | {' | '.join(cells)}", flush=True)


def decode_table(seqs=(1, 4, 16, 64), keys: int = 128) -> None:
    from meshserve.attention.backends.cpu_paged_decode import paged_decode_op

    op = paged_decode_op()
    if op is None:
        print("paged decode kernel unavailable (see the warning)")
        return
    H, Hkv, D, bs = 4, 2, 64, 16
    print(f"S x {keys} keys | kernel warm | kernel cold | torch decode_bags warm | cold   (us per layer)")
    for S in seqs:
        nblk = S * keys // bs * 2
        caches = [torch.randn(nblk, 2, bs, Hkv, D) for _ in range(8)]
        table = torch.randperm(nblk)[: S * keys // bs].view(S, keys // bs).to(torch.int32)
        lens = torch.full((S,), keys, dtype=torch.int32)
        q, none = torch.randn(S, H, D), torch.empty(0)
        base = ((table.long()[:, :, None] * 2 * bs + torch.arange(bs)) * Hkv).reshape(S, 1, keys)
        base = base + torch.arange(Hkv)[None, :, None]
        v_bags = (base + bs * Hkv).repeat_interleave(H // Hkv, dim=1).reshape(-1)
        offsets = torch.arange(0, S * H * keys, keys)

        kern = [functools.partial(op, q, c, table, lens, D**-0.5, 0.0, none) for c in caches]
        torch_ops = [functools.partial(_bags, q, c, base.reshape(-1), v_bags, offsets) for c in caches]
        print(f"{S} | {_median_us(kern[:1], 50):.0f} | {_median_us(kern, 20):.0f} | "
              f"{_median_us(torch_ops[:1], 50):.0f} | {_median_us(torch_ops, 20):.0f}", flush=True)


def _bags(q: torch.Tensor, cache: torch.Tensor, k_rows: torch.Tensor, v_bags: torch.Tensor,
          offsets: torch.Tensor) -> torch.Tensor:
    """CPU_SDPA's torch decode path (decode_bags): K gathered, V summed in place."""
    S, H, D = q.shape
    Hkv = cache.shape[3]
    rows = cache.view(-1, D)
    k = rows.index_select(0, k_rows).view(S, Hkv, -1, D)
    p = torch.softmax(torch.matmul(q.view(S, Hkv, H // Hkv, D) * D**-0.5, k.transpose(-1, -2)), -1)
    return F.embedding_bag(v_bags, rows, offsets, per_sample_weights=p.reshape(-1), mode="sum")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["linear", "decode"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {args.threads} thread(s)")
    if args.only in (None, "linear"):
        linear_table()
    if args.only in (None, "decode"):
        decode_table()


if __name__ == "__main__":
    main()
