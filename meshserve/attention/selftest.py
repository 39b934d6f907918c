"""`meshserve doctor`: run one tiny attention step through every registered backend on this machine.

Each backend the machine can load and that accepts the problem is built, plans a small mixed
batch (a whole prompt, a prompt chunk after cached context, two decodes) over a paged cache
with shuffled blocks, writes the new K/V through its own `write_kv` and attends; the output is
compared with a float64 computation done here, independently of every backend. On a CPU the
TRITON kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set before they are
imported). This is the smoke test of an image: it compiles and runs real kernels.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch

from meshserve.attention.backend import AttentionProblem, KVCache
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.registry import BACKENDS, PRIORITIES, judge, load_backend, platform_of
from meshserve.attention.spec import AttentionSpec
from meshserve.core.arith import cdiv

# (context already cached, new tokens) per sequence: prefills first, then decodes.
BATCH = ((0, 20), (16, 9), (37, 1), (70, 1))
BLOCK_SIZE = 16
# Largest relative error allowed: float32 on a CPU; bfloat16 on a GPU (8 bits of mantissa).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


@dataclass(frozen=True)
class BackendCheck:
    """status: "pass", "fail" (ran, but wrong or raised) or "absent" (cannot run here; `detail` says why)."""

    name: str
    status: str
    detail: str


def check_backends(device: str | None = None) -> list[BackendCheck]:
    """Every registered backend, the machine's priority order first."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    cc = torch.cuda.get_device_capability() if device == "cuda" else None
    dtype = "bfloat16" if device == "cuda" else "float32"
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64)
    problem = AttentionProblem(spec=spec, dtype=dtype, block_size=BLOCK_SIZE, max_model_len=256, device=device,
                               compute_capability=cc)
    order = list(PRIORITIES[platform_of(problem)]) + [n for n in BACKENDS if n not in PRIORITIES[platform_of(problem)]]
    results = []
    for name in dict.fromkeys(order):
        verdict = judge(name, problem)
        if not verdict.ok:
            results.append(BackendCheck(name, "absent", "; ".join(verdict.reasons)))
            continue
        try:
            err = _run_one(load_backend(name)(problem), spec, dtype, device)
        except Exception as exc:  # a backend that raises is exactly what this command reports
            if device == "cpu" and "active drivers" in str(exc):  # no GPU and no interpreter: not a broken backend
                results.append(BackendCheck(name, "absent", "Triton has no CPU driver in this process: its kernels "
                                            "were imported before TRITON_INTERPRET=1 was set"))
                continue
            last = traceback.extract_tb(exc.__traceback__)[-1]
            results.append(BackendCheck(name, "fail", f"{type(exc).__name__}: {exc} ({last.filename}:{last.lineno})"))
            continue
        ok = err <= TOLERANCE[dtype]
        results.append(BackendCheck(name, "pass" if ok else "fail",
                                    f"max relative error {err:.1e} against float64 (allowed {TOLERANCE[dtype]:.0e})"))
    return results


def _run_one(backend, spec: AttentionSpec, dtype: str, device: str) -> float:
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_size
    seq_lens = [c + n for c, n in BATCH]
    blocks = torch.randperm(64, generator=gen)[1:].tolist()  # block 0 stays unused (the null block)
    tables = []
    for s in seq_lens:
        n = cdiv(s, BLOCK_SIZE)
        tables.append(blocks[:n])
        blocks = blocks[n:]
    keys = [torch.randn(s, Hkv, D, generator=gen, dtype=torch.float64) for s in seq_lens]
    values = [torch.randn(s, Hkv, D, generator=gen, dtype=torch.float64) for s in seq_lens]
    queries = [torch.randn(n, H, D, generator=gen, dtype=torch.float64) for _, n in BATCH]
    torch_dtype = getattr(torch, dtype)
    # The cached context is stored rounded to the cache dtype, as the oracle sees it.
    keys = [k.to(torch_dtype).double() for k in keys]
    values = [v.to(torch_dtype).double() for v in values]
    queries = [q.to(torch_dtype).double() for q in queries]
    data = torch.randn(64, 2, BLOCK_SIZE, Hkv, D, generator=gen) * 100  # garbage outside the sequences
    data = data.to(torch_dtype)
    for (context, _), table, k, v in zip(BATCH, tables, keys, values):
        for pos in range(context):
            data[table[pos // BLOCK_SIZE], 0, pos % BLOCK_SIZE] = k[pos].to(torch_dtype)
            data[table[pos // BLOCK_SIZE], 1, pos % BLOCK_SIZE] = v[pos].to(torch_dtype)
    cache = KVCache(data.to(device))
    meta = AttentionMetadata.build(query_lens=[n for _, n in BATCH], seq_lens=seq_lens, block_tables=tables,
                                   block_size=BLOCK_SIZE, device=device)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, BATCH)]).to(torch_dtype).to(device)
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, BATCH)]).to(torch_dtype).to(device)
    query = torch.cat(queries).to(torch_dtype).to(device)
    plan = backend.plan(meta)
    backend.write_kv(new_k, new_v, cache, meta.slot_mapping)
    out = backend.forward(query, new_k, new_v, cache, plan).double().cpu()  # [T, H, D]
    want = torch.cat([_reference(q, k, v, c, spec) for q, k, v, (c, _) in zip(queries, keys, values, BATCH)])
    return float((out - want).abs().max() / want.abs().max())


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, spec: AttentionSpec) -> torch.Tensor:
    """Causal attention of one sequence's new queries [n, H, D] over its keys [s, Hkv, D], float64."""
    group = spec.num_heads // spec.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [s, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * spec.softmax_scale
    q_pos = torch.arange(context, context + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
