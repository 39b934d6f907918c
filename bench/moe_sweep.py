"""Tile sweep of the fused MoE GEMMs (`python -m bench.moe_layer --sweep`), for picking the
defaults in fused_moe.TILE_TABLE in one H200 run.

Per (shape, T): for each block_m, every gate_up candidate is timed with the current down tiles
and every down candidate with the current gate_up tiles (the other GEMM is a constant offset),
then the best pair is timed together. Times: CUDA-event medians, under CUDA-graph replay for
T <= 64 (as decode runs), eager above. Each candidate is checked against the default
configuration's output first; one that fails to compile or disagrees is listed, not timed. A
time budget (split evenly over the (shape, T) groups) keeps one run inside the device's
10-minute command limit: candidates are ordered most-promising first and the rest are skipped
when a group's budget is spent.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, replace

import torch


@dataclass
class SweepRow:
    shape: str
    tokens: int
    gemm: str  # "gate_up" / "down" / "pair" / "default"
    config: str
    us: float | None
    note: str = ""


def _gemm_candidates(block_m: int, gemm: str):
    """GemmTiles candidates, most promising first; pruned by registers and shared memory."""
    from meshserve.workers.models.fused_moe import GemmTiles

    ns = (64, 128, 32) if gemm == "gate_up" else (128, 64, 256)
    for n, k, w, s in itertools.product(ns, (64, 128), (4, 8), (3, 4)):
        width = 2 * n if gemm == "gate_up" else n  # gate_up keeps two accumulators
        if block_m * width > 16384 or (block_m * k + width * k) * 2 * s > 200 * 1024:
            continue
        yield GemmTiles(n, k, w, s)


def _measure(cfg, x, w, ids, ew, want) -> float | str:
    """Microseconds of fused_moe with tiles cfg (graph replay for T <= 64), or why not timed."""
    from bench.common import graphed, rel_err, time_us
    from meshserve.workers.models.fused_moe import fused_moe

    def fn():
        return fused_moe(x, w, ids, ew, config=cfg)

    try:
        err = rel_err(fn(), want)
    except Exception as exc:  # a tile that does not compile (shared memory, registers)
        return f"failed: {type(exc).__name__}: {str(exc)[:60]}"
    if err > 3e-2:
        return f"disagrees ({err:.1e})"
    T, cuda = x.shape[0], x.is_cuda
    return time_us(graphed(fn) if cuda and T <= 64 else fn, x.device.type, 10 if T >= 1024 or not cuda else 30)


def _row(shape, T: int, gemm: str, cfg, us: float | str) -> SweepRow:
    timed = isinstance(us, float)
    return SweepRow(shape.name, T, gemm, repr(cfg), us if timed else None, "" if timed else us)


def sweep_tokens(shape, ew, route, T: int, budget_s: float) -> list[SweepRow]:
    """One (shape, T) group: ew the packed ExpertWeights, route(x) -> (weights, ids)."""
    from meshserve.workers.models.fused_moe import TileConfig, fused_moe, tile_config

    t_end = time.perf_counter() + budget_s
    device = ew.w13.device
    gen = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, shape.hidden, generator=gen, device=device).to(ew.w13.dtype)
    w, ids = route(x)
    want = fused_moe(x, w, ids, ew)
    default = tile_config(T * ids.shape[1], ew.num_experts)
    out = [_row(shape, T, "default", default, _measure(default, x, w, ids, ew, want))]
    for block_m in (16, 32, 64) if T <= 256 else (64, 128):
        start = TileConfig(block_m, default.gate_up, default.down)
        best = {}
        for gemm in ("gate_up", "down"):
            timed = []
            for tiles in _gemm_candidates(block_m, gemm):
                if time.perf_counter() > t_end:
                    out.append(SweepRow(shape.name, T, gemm, f"block_m={block_m}", None,
                                        "budget spent: the rest of this group skipped"))  # fmt: skip
                    break
                cfg = replace(start, **{gemm: tiles})
                out.append(_row(shape, T, gemm, cfg, _measure(cfg, x, w, ids, ew, want)))
                if out[-1].us is not None:
                    timed.append((out[-1].us, tiles))
            best[gemm] = min(timed, key=lambda p: p[0])[1] if timed else getattr(start, gemm)
        pair = replace(start, gate_up=best["gate_up"], down=best["down"])
        out.append(_row(shape, T, "pair", pair, _measure(pair, x, w, ids, ew, want)))
    print(f"  sweep {shape.name} T={T} done", flush=True)
    return out


def _short(config: str) -> str:
    """TileConfig(block_m=16, gate_up=GemmTiles(block_n=64, ...), ...) -> m16 gate_up 64/64/w4/s3 down ..."""
    for long, short in (("TileConfig(block_m=", "m"), ("GemmTiles(", ""), ("block_n=", ""),
                        ("block_k=", ""), ("num_warps=", "w"), ("num_stages=", "s"), ("=", " "), (", ", "/"),
                        (")", "")):  # fmt: skip
        config = config.replace(long, short)
    return config.replace("/gate_up", " gate_up").replace("/down", " down")


def print_sweep(rows: list[SweepRow], top: int = 5) -> None:
    """The fastest candidates of each (shape, T, GEMM) and the winning pair against the default."""
    print(f"\n{'shape':18} {'T':>5} {'gemm':8} {'us':>9}  config")
    groups = dict.fromkeys((r.shape, r.tokens) for r in rows)
    for shape, T in groups:
        mine = [r for r in rows if (r.shape, r.tokens) == (shape, T)]
        default = next((r for r in mine if r.gemm == "default"), None)
        for gemm in ("gate_up", "down", "pair"):
            timed = sorted((r for r in mine if r.gemm == gemm and r.us is not None), key=lambda r: r.us)
            for r in timed[: (1 if gemm == "pair" else top)]:
                print(f"{shape:18} {T:5d} {gemm:8} {r.us:9.1f}  {_short(r.config)}")
        pairs = sorted((r for r in mine if r.gemm == "pair" and r.us is not None), key=lambda r: r.us)
        if pairs and default is not None and default.us is not None:
            print(f"{shape:18} {T:5d} {'WINNER':8} {pairs[0].us:9.1f}  (default {default.us:.1f} us: "
                  f"{default.us / pairs[0].us:.2f}x) paste: {pairs[0].config}")  # fmt: skip
        failed = [r for r in mine if r.us is None]
        if failed:
            print(f"{shape:18} {T:5d} {len(failed)} candidates not timed (first: {failed[0].note})")


def plot_sweep(rows: list[SweepRow], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r.shape, r.tokens) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    for i, (shape, T) in enumerate(groups):
        mine = [r for r in rows if (r.shape, r.tokens) == (shape, T) and r.us is not None]
        default = next((r.us for r in mine if r.gemm == "default"), None)
        if not default:
            continue
        for j, gemm in enumerate(("gate_up", "down", "pair")):
            ys = [default / r.us for r in mine if r.gemm == gemm]
            ax.scatter([i + (j - 1) * 0.2] * len(ys), ys, s=8, label=gemm if i == 0 else None, color=f"C{j}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{s}\nT={t}" for s, t in groups], fontsize=8)
    ax.set_ylabel("speed-up over the default tiles")
    ax.set_title("fused MoE tile sweep (each point: one candidate)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def as_json(rows: list[SweepRow]) -> list[dict]:
    return [asdict(r) for r in rows]
