"""DeepSeek decode steps, eager against CUDA graphs, per MLA decode backend, in the same run.

A DeepSeek-V2-Lite-shaped checkpoint with random bf16 weights (bench/e2e_deepseek.py: hidden
2048, 16 heads, latent 512 + rope 64, nope 128, v 128; 64 routed experts of 1408, top-6, 2 shared;
the first layer dense) is written with HF's parameter names, `--layers` of them (default 4: one
dense, three MoE). Per MLA decode
backend (TRITON, FLASHINFER) and per batch size, the engine's decode steps are timed eagerly
(`enforce_eager=True`) and with decode graphs, one engine after the other on the same
checkpoint: wall ms per step (the engine's whole step), GPU-busy ms and kernels per step (torch
profiler), and whether greedy tokens of a few prompts are identical between the two.

    python -m bench.deepseek_graphs                              # on the H200: TRITON and FLASHINFER, bs 1/16/64
    python -m bench.deepseek_graphs --backends FLASHINFER --batch-sizes 1,64
    python -m bench.deepseek_graphs --device cpu --tiny          # CPU smoke run (eager only there)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from bench.common import int_list, random_prompts
from bench.e2e import decode_steps
from bench.e2e_deepseek import DEEPSEEK_V2_LITE, TINY_DEEPSEEK, with_layers, write_checkpoint


def run_engine(path: Path, args: argparse.Namespace, backend: str, *, eager: bool, vocab: int) -> dict:
    from meshserve import LLM, SamplingParams

    llm = LLM(path, dtype=args.dtype, attention_backend=backend, device=args.device, max_model_len=1024,
              kv_cache_memory_bytes=args.kv_bytes, max_num_seqs=max(args.batch_sizes), enforce_eager=eager,
              progress=False)  # fmt: skip
    runner = llm.core.executor.worker.runner
    graphs = runner.decode_graphs
    out = {"graphs": graphs is not None, "decode": runner.backends[0].decode.name, "steps": {}}
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out["tokens"] = [o.token_ids for o in llm.generate(random_prompts(4, 40, vocab, 7), greedy)]
    for bs in args.batch_sizes:
        out["steps"][bs] = r = decode_steps(llm, bs, args, vocab)
        print(f"{backend:10s} {'graphs' if graphs is not None else 'eager ':6s} bs={bs:<3} "
              f"{r['wall_s'] * 1e3:7.2f} ms/step  busy {r['busy_s'] * 1e3:6.2f} ms  {r['kernels']:.0f} kernels",
              flush=True)  # fmt: skip
    if graphs is not None:
        out["capture_s"], out["capture_mib"] = graphs.capture_seconds, graphs.capture_bytes / 2**20
    llm.shutdown()
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _first_difference(eager: dict, graphs: dict) -> str:
    """Where the greedy tokens part: in bf16 a replay may differ from the eager step in the last bit
    (TRITON MLA splits the keys for max_model_len under a graph, by the step's lengths eagerly),
    and on random weights a near-tie then flips a later token."""
    parts = [next((j for j, (a, b) in enumerate(zip(e, g)) if a != b), min(len(e), len(g)))
             for e, g in zip(eager["tokens"], graphs["tokens"])]
    differ = [(i, j) for i, j in enumerate(parts) if eager["tokens"][i] != graphs["tokens"][i]]
    return " (" + ", ".join(f"prompt {i} from token {j}" for i, j in differ) + ")"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="layers written (default 4; tiny: 2)")
    ap.add_argument("--backends", default="TRITON,FLASHINFER", help="MLA decode backends, comma-separated")
    ap.add_argument("--batch-sizes", default=None, help="default 1,16,64 (tiny: 1,4)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--kv-bytes", type=int, default=8 << 30)
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--out", default=None, help="folder for deepseek_graphs.json")
    args = ap.parse_args(argv)
    shape = with_layers(TINY_DEEPSEEK if args.tiny else DEEPSEEK_V2_LITE, args.layers or (None if args.tiny else 4))
    args.batch_sizes = int_list(args.batch_sizes or ("1,4" if args.tiny else "1,16,64"))
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.host_profile = args.timeline = False
    if args.tiny:
        args.kv_bytes, args.prompt_len = 64 << 20, 16
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="deepseek_graphs_"))
    workdir.mkdir(parents=True, exist_ok=True)
    total = write_checkpoint(workdir, shape, torch.bfloat16, args.device)
    print(f"checkpoint: {total / 1e9:.2f} GB, {shape['num_hidden_layers']} layers, in {workdir}", flush=True)
    results = {}
    for backend in args.backends.split(","):
        eager = run_engine(workdir, args, backend, eager=True, vocab=shape["vocab_size"])
        graphs = run_engine(workdir, args, backend, eager=False, vocab=shape["vocab_size"])
        same = eager["tokens"] == graphs["tokens"]
        print(f"{backend}: decode backend {graphs['decode']}, graphs captured: {graphs['graphs']} "
              f"({graphs.get('capture_s', 0):.1f} s, {graphs.get('capture_mib', 0):.0f} MiB); "
              f"greedy tokens graphs == eager: {same}{'' if same else _first_difference(eager, graphs)}",
              flush=True)  # fmt: skip
        for bs in args.batch_sizes:
            e, g = eager["steps"][bs]["wall_s"], graphs["steps"][bs]["wall_s"]
            print(f"| {backend} | {bs} | {e * 1e3:.2f} | {g * 1e3:.2f} | {e / g:.2f}x |", flush=True)
        results[backend] = {"eager": eager, "graphs": graphs, "tokens_equal": same}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "deepseek_graphs.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {out / 'deepseek_graphs.json'}")
    if args.workdir is None:
        shutil.rmtree(workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
