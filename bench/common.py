"""What several benchmarks share: random prompts, checkpoint shards, timing and error helpers.

Benchmarks import this module (and bench/report.py) instead of each other, so no two benches
import one another (tests/unit/test_bench_imports.py checks that bench/ has no import cycle).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids in [3, vocab), reproducible from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def int_list(text: str) -> list[int]:
    """'1,16,64' or '1 16 64' -> [1, 16, 64] (a CLI list; empty entries skipped)."""
    return [int(x) for x in text.replace(",", " ").split()]


def save_shards(path: Path, shards: list[dict[str, torch.Tensor]]) -> int:
    """Each dict as one safetensors shard, plus the index; returns the bytes written."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        for t_name, t in tensors.items():
            weight_map[t_name] = name
            total += t.numel() * t.element_size()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a MoE layer reads for `tokens` tokens: top_k for one token, else the expected number
    of distinct experts when each token picks top_k of num_experts uniformly at random (an expert
    escapes one token with probability 1 - top_k / num_experts)."""
    if tokens == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (b is the reference)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def shuffled_tables(batch: int, per_seq: int, gen: torch.Generator) -> list[list[int]]:
    """Block tables of `batch` sequences over a shuffled pool (paging bugs show)."""
    perm = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    return perm.tolist()


def capture_graph(fn: Callable[[], object], *, warmups: int = 2) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after `warmups` runs on a side stream (compiles, probes and
    lazily allocated buffers stay outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """fn captured in a CUDA graph (as decode steps run it): replaying costs no launch overhead."""
    return capture_graph(fn).replay


def graph_replay_ms(step: Callable[[], object], *, replays: int = 20) -> tuple[list[float], torch.cuda.CUDAGraph]:
    """step() captured in one CUDA graph (capture_graph), then ms of each of `replays` timed
    replays (CUDA events), and the graph (for its kernel count; the caller drops it)."""
    graph = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, graph


def graph_replays_equal(eager: torch.Tensor, step: Callable[[], torch.Tensor], label: str) -> bool:
    """Whether step() captured in a CUDA graph gives `eager`'s bits on each of three replays (the
    graph contract a decode kernel must keep); a capture that fails is a False verdict, printed
    under `label`. step must be compiled already (run eagerly once)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        same = True
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            same = same and torch.equal(out, eager)
    except Exception as exc:  # noqa: BLE001 - a capture failure is a verdict
        print(f"graph check {label}: {str(exc).splitlines()[0][:160]}", flush=True)
        return False
    return same


def time_us(fn: Callable[[], object], device: str, iters: int) -> float:
    """Median time of fn() in microseconds: CUDA events on CUDA, the host clock elsewhere."""
    for _ in range(3):
        fn()
    if device != "cuda":
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t) * 1e6
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0


def time_us_l2_flushed(fn: Callable[[], object], *, warmup: int = 5, iters: int = 30) -> float:
    """Median of CUDA-event timings of fn(), with L2 flushed (256 MB write) before each call."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0
