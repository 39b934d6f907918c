"""MLA decode on the GPU: TRITON (absorbed split-KV, meshserve) vs FlashInfer's MLA decode, side by side.

DeepSeek-V3 shapes: 128 heads, latent 512, rope 64, pages of 64 tokens, bf16. Both sides get
the same absorbed queries (q_lat = W_UK^T q_nope, q_pe) and the same latent cache, and produce
o_lat [B, 128, 512]; the absorption and W_UV matmuls, identical for both, are left out. Timed
with CUDA events (triton.testing.do_bench, median, L2 flushed between runs) after warm-up;
random data; the cache (hundreds of MB) is far larger than L2.

    python bench/attention_mla.py [--sweep] [--out DIR]
    TRITON_INTERPRET=1 python bench/attention_mla.py --dry-run   # CPU: the script's logic, tiny shapes

Prints a table per shape (time, latent bytes read per second, TFLOP/s, speed vs FlashInfer)
and writes mla_decode.json / mla_decode.md under --out. FlashInfer's JIT build runs in a
background process while the Triton kernels compile and run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshserve.attention.backend import AttentionProblem  # noqa: E402
from meshserve.attention.metadata import AttentionMetadata  # noqa: E402
from meshserve.attention.mla.backends.triton_common import MLADecodeConfig, decode_config  # noqa: E402
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend  # noqa: E402
from meshserve.attention.mla.cache import LatentCache  # noqa: E402
from meshserve.attention.mla.spec import mla_spec  # noqa: E402
from meshserve.attention.spec import MLADims  # noqa: E402

HEADS, PAGE = 128, 64
V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
SCALE = V3.qk_head_dim**-0.5
SHAPES = ((64, 4096), (128, 2048), (32, 8192), (8, 32768))
SWEEP = (  # block_h, block_n, num_warps, num_stages
    (64, 16, 8, 2), (64, 16, 8, 3), (64, 32, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2),
)  # fmt: skip


DEVICE, DTYPE = "cuda", torch.bfloat16  # --dry-run: cpu, float32


def make_inputs(batch: int, seq_len: int, seed: int = 0) -> dict:
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages = -(-seq_len // PAGE)
    num_blocks = batch * pages + 8
    cache = LatentCache.allocate(num_blocks, PAGE, V3, dtype=DTYPE, device=dev)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen, device=dev, dtype=DTYPE))
    perm = torch.randperm(num_blocks, generator=gen, device=dev)[: batch * pages].view(batch, pages)
    tables = perm.int().cpu().tolist()
    meta = AttentionMetadata.build(query_lens=[1] * batch, seq_lens=[seq_len] * batch, block_tables=tables,
                                   block_size=PAGE, device=dev)  # fmt: skip
    q_lat = torch.randn(batch, HEADS, V3.kv_lora_rank, generator=gen, device=dev, dtype=DTYPE) * 0.05
    q_pe = torch.randn(batch, HEADS, V3.qk_rope_head_dim, generator=gen, device=dev, dtype=DTYPE)
    return dict(cache=cache, meta=meta, q_lat=q_lat, q_pe=q_pe, batch=batch, seq_len=seq_len)


def problem() -> AttentionProblem:
    cc = torch.cuda.get_device_capability() if DEVICE == "cuda" else None
    return AttentionProblem(spec=mla_spec(HEADS, V3, scale=SCALE), dtype=str(DTYPE).removeprefix("torch."),
                            block_size=PAGE, max_model_len=1 << 17, device=DEVICE, compute_capability=cc)  # fmt: skip


def reference(inp: dict, rows: int = 3) -> torch.Tensor:
    """float32 latent-space attention of the first `rows` sequences: o_lat [rows, H, 512]."""
    cache, meta, r = inp["cache"], inp["meta"], V3.kv_lora_rank
    outs = []
    for b in range(min(rows, inp["batch"])):
        n = inp["seq_len"]
        blocks = meta.block_table[b, : -(-n // PAGE)].long()
        kv = cache.data[blocks].reshape(-1, cache.data.shape[2])[:n].float()
        s = (inp["q_lat"][b].float() @ kv[:, :r].T + inp["q_pe"][b].float() @ kv[:, r:].T) * SCALE
        outs.append(torch.softmax(s, dim=-1) @ kv[:, :r])
    return torch.stack(outs)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def time_ms(fn) -> float:
    if DEVICE != "cuda":  # dry run: one call, wall clock
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def run_triton(inp: dict, cfg: MLADecodeConfig) -> tuple[float, float, dict]:
    backend = TritonMLADecodeBackend(problem(), config=cfg)
    plan = backend.plan(inp["meta"])
    fn = lambda: backend.attend_latent(inp["q_lat"], inp["q_pe"], inp["cache"], plan)
    out, _ = fn()
    err = rel_err(out[:3], reference(inp))
    info = dict(splits=plan.num_splits, partition=plan.partition, **kernel_resources())
    return time_ms(fn), err, info


def kernel_resources() -> dict:
    """Registers, spills and whether wgmma was used, for the last compiled decode kernel."""
    try:
        from meshserve.attention.kernels.mla_decode import mla_decode_kernel

        caches = mla_decode_kernel.device_caches[torch.cuda.current_device()][0]  # noqa: SLF001
        k = list(caches.values())[-1]
        return dict(regs=k.n_regs, spills=k.n_spills, wgmma="wgmma" in k.asm.get("ptx", ""))
    except Exception as exc:  # diagnostics only: Triton's internals move between versions
        return dict(resources=f"unavailable: {type(exc).__name__}")


def flashinfer_wrapper(inp: dict):
    import flashinfer

    meta, batch, seq_len = inp["meta"], inp["batch"], inp["seq_len"]
    pages = -(-seq_len // PAGE)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    indptr = torch.arange(batch + 1, dtype=torch.int32)
    wrapper.plan(indptr, indptr * pages, meta.block_table[:, :pages].reshape(-1).contiguous(),
                 torch.full((batch,), seq_len, dtype=torch.int32), HEADS, V3.kv_lora_rank, V3.qk_rope_head_dim,
                 PAGE, False, SCALE, DTYPE, DTYPE)  # fmt: skip
    return wrapper


def run_flashinfer(inp: dict) -> tuple[float, float, dict]:
    wrapper = flashinfer_wrapper(inp)
    cache = inp["cache"]
    fn = lambda: wrapper.run(inp["q_lat"], inp["q_pe"], cache.latent, cache.rope)
    out = fn()
    return time_ms(fn), rel_err(out[:3], reference(inp)), dict(backend=wrapper._backend)


def rates(batch: int, seq_len: int, ms: float) -> tuple[float, float]:
    """(TB/s of latent cache read, TFLOP/s): QK over 576 dims and PV over 512, per head and key."""
    bytes_read = batch * seq_len * V3.latent_size * 2
    flops = batch * seq_len * HEADS * 2 * (V3.latent_size + V3.kv_lora_rank)
    return bytes_read / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / 1e12


def warm_flashinfer_in_background() -> subprocess.Popen | None:
    """Build FlashInfer's MLA kernel (JIT, tens of seconds) in another process meanwhile."""
    if DEVICE != "cuda" or importlib.util.find_spec("flashinfer") is None:
        return None
    code = ("import sys; sys.path.insert(0, %r); import bench.attention_mla as b; i = b.make_inputs(2, 128); "
            "w = b.flashinfer_wrapper(i); w.run(i['q_lat'], i['q_pe'], i['cache'].latent, i['cache'].rope); "
            "print('flashinfer MLA built', flush=True)")  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", code % str(Path(__file__).resolve().parents[1])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every tile shape in SWEEP on the first shape")
    parser.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, float32, tiny shapes")
    args = parser.parse_args()
    if args.dry_run:
        global DEVICE, DTYPE, HEADS, SWEEP
        DEVICE, DTYPE, HEADS, SWEEP = "cpu", torch.float32, 16, SWEEP[:1]
        args.shapes = "2x200"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    t0 = time.time()
    builder = warm_flashinfer_in_background()
    results: dict = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", shapes={}, sweep=[])
    default = decode_config(HEADS, str(DTYPE).removeprefix("torch."), DEVICE)
    configs = [default]
    if args.sweep:
        inp = make_inputs(*shapes[0])
        for bh, bn, warps, stages in SWEEP:
            for per_sm in (1, 2):
                cfg = MLADecodeConfig(bh, bn, warps, stages, per_sm, 256)
                try:
                    ms, err, info = run_triton(inp, cfg)
                    row = dict(config=cfg.__dict__, us=ms * 1e3, err=err, **info)
                except Exception as exc:  # a tile shape that does not fit is a result, not a crash
                    row = dict(config=cfg.__dict__, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                results["sweep"].append(row)
                print("sweep", json.dumps(row), f"[{time.time() - t0:.0f}s]", flush=True)
        good = [r for r in results["sweep"] if "us" in r and r["err"] < 2e-2]
        good.sort(key=lambda r: r["us"])
        configs = [MLADecodeConfig(**r["config"]) for r in good[:2]] or [default]
        del inp
    if builder is not None:
        builder.wait()
    for batch, seq_len in shapes:
        inp = make_inputs(batch, seq_len)
        row: dict = {}
        try:
            ms, err, info = run_flashinfer(inp)
            row["FLASHINFER"] = dict(us=ms * 1e3, err=err, **info)
        except Exception as exc:
            row["FLASHINFER"] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
        for i, cfg in enumerate(configs):
            try:
                ms, err, info = run_triton(inp, cfg)
                row[f"TRITON{'' if i == 0 else i}"] = dict(us=ms * 1e3, err=err, config=cfg.__dict__, **info)
            except Exception as exc:
                row[f"TRITON{'' if i == 0 else i}"] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
        results["shapes"][f"{batch}x{seq_len}"] = row
        print(f"shape {batch}x{seq_len}", json.dumps(row), f"[{time.time() - t0:.0f}s]", flush=True)
        del inp
        torch.cuda.empty_cache()
    table = format_table(results)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_decode.json").write_text(json.dumps(results, indent=1))
    (args.out / "mla_decode.md").write_text(table + "\n")


def format_table(results: dict) -> str:
    lines = [f"MLA decode, {results['device']}: 128 heads, latent 512 + rope 64, page 64, bf16",
             "| batch x kv len | backend | time (us) | latent TB/s | TFLOP/s | rel err | speed vs FLASHINFER |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for shape, row in results["shapes"].items():
        batch, seq_len = (int(v) for v in shape.split("x"))
        fi = row.get("FLASHINFER", {}).get("us")
        for name, r in row.items():
            if "us" not in r:
                lines.append(f"| {shape} | {name} | {r.get('error', '-')} | | | | |")
                continue
            tbs, tflops = rates(batch, seq_len, r["us"] / 1e3)
            ratio = f"{fi / r['us']:.2f}x" if fi else "-"
            lines.append(f"| {shape} | {name} | {r['us']:.1f} | {tbs:.2f} | {tflops:.0f} | {r['err']:.1e} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
