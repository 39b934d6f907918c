"""`meshserve bench`: load a running `meshserve serve` (or any OpenAI-compatible server) and report.

    meshserve bench --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 --input-len 128 \\
        --output-len 64                      # prints the summary, writes meshserve-bench-*.json and .png
    meshserve bench --backend openai-chat --dataset ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 500
    meshserve bench --backend grpc --address 127.0.0.1:50051 --max-concurrency 16 --range-ratio 0.5

Nothing listening at the address: one line on stderr and exit status 1 within --connect-timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

BACKENDS = {"openai": "POST /v1/completions (SSE)", "openai-chat": "POST /v1/chat/completions (SSE)",
            "grpc": "meshserve.v1.Inference/Generate"}


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="serving benchmark against a running server (OpenAI HTTP or gRPC): "
                                            "TTFT, TPOT, ITL percentiles, throughputs, JSON and PNG")
    t = p.add_argument_group("the server")
    t.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="; ".join(f"{k}: {v}" for k, v in BACKENDS.items()))
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="the OpenAI API's root (openai backends)")
    t.add_argument("--address", default="127.0.0.1:50051", help="host:port (grpc backend)")
    t.add_argument("--model", default="", help="model name (default: the server's first)")
    t.add_argument("--auth-token-file", default=None, help="file holding the server's bearer token")
    t.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="give up when the server has not answered its model list within this time (default 5)")
    w = p.add_argument_group("the load")
    w.add_argument("--dataset", default=None, metavar="FILE",
                   help="ShareGPT-format JSON (conversations' first turn as prompt, second turn's length as output "
                        "length); default: random token-id prompts of --input-len")
    w.add_argument("--num-prompts", type=int, default=100, help="measured requests")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (random prompts)")
    w.add_argument("--output-len", type=int, default=None,
                   help="output tokens, EOS ignored (default 64; with --dataset: each reply's own length)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths")
    w.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: at once)")
    w.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    w.add_argument("--num-warmups", type=int, default=2, help="requests sent first and not counted")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output (by default meshserve-bench-BACKEND-TIME.json and .png in --result-dir)")
    o.add_argument("--result-dir", default=".", help="folder of the default JSON and PNG (default: here)")
    o.add_argument("--result-json", default=None, help="write the summary and every request's timings here")
    o.add_argument("--plot", default=None, help="write the PNG (latency CDFs, throughput over time) here")
    o.add_argument("--no-save", action="store_true", help="print the summary only, write no files")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on a terminal)")
    p.set_defaults(func=bench_main)
    return p


def _backend(args, token):
    from meshserve.api.bench.loadgen import GrpcBackend, OpenAIBackend

    if args.backend == "grpc":
        return GrpcBackend(args.address, token=token, model=args.model)
    return OpenAIBackend(args.base_url, token=token, model=args.model, chat=args.backend == "openai-chat")


async def _requests(args, spec, backend, vocab_size: int, max_model_len: int):
    """(requests, warm-ups): the dataset's, or random ones (as text for chat, which takes no token ids)."""
    from meshserve.api.bench.datasets import sharegpt_requests
    from meshserve.api.bench.loadgen import BenchRequest, make_requests

    if args.dataset is not None:
        picked = await sharegpt_requests(args.dataset, count=spec.num_prompts + spec.num_warmups, seed=spec.seed,
                                         max_model_len=max_model_len, tokenize=backend.tokenize,
                                         output_len=args.output_len)
        return picked[spec.num_warmups:], picked[:spec.num_warmups]
    requests = make_requests(spec, vocab_size=vocab_size, count=spec.num_prompts)
    warmups = make_requests(spec, vocab_size=vocab_size, count=spec.num_warmups, seed_offset=7_919)
    if args.backend == "openai-chat":
        async def as_text(r: BenchRequest) -> BenchRequest:
            return BenchRequest(await backend.detokenize(list(r.prompt)), r.max_tokens, r.seed,
                                prompt_tokens=len(r.prompt))

        requests = list(await asyncio.gather(*(as_text(r) for r in requests)))
        warmups = list(await asyncio.gather(*(as_text(r) for r in warmups)))
    return requests, warmups


async def _run(args, spec, token):
    from meshserve.api.bench.loadgen import run_load

    backend = _backend(args, token)
    try:
        model, vocab_size, max_model_len = await backend.model_info(timeout=args.connect_timeout)
        backend.model = model
        requests, warmups = await _requests(args, spec, backend, vocab_size, max_model_len)
        bar = _progress(len(requests), disable=args.no_progress)
        try:
            samples, wall = await run_load(backend, spec, vocab_size=vocab_size, requests=requests, warmups=warmups,
                                           on_done=lambda s: bar.update(1))
        finally:
            bar.close()
    finally:
        await backend.close()
    return model, samples, wall


def _progress(total: int, *, disable: bool):
    from tqdm import tqdm

    # disable=None: tqdm draws only on a terminal, so logs and pipes stay clean
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=True if disable else None,
                dynamic_ncols=True, leave=False)


def _default_paths(args) -> tuple[Path | None, Path | None]:
    if args.no_save:
        return (Path(args.result_json) if args.result_json else None, Path(args.plot) if args.plot else None)
    stem = Path(args.result_dir) / f"meshserve-bench-{args.backend}-{time.strftime('%Y%m%d-%H%M%S')}"
    return (Path(args.result_json or f"{stem}.json"), Path(args.plot or f"{stem}.png"))


def bench_main(args: argparse.Namespace) -> int:
    from meshserve.api.bench.loadgen import LoadSpec, ServerUnreachable
    from meshserve.api.bench.report import plot, summarize, table, write_json

    output_len = args.output_len if args.output_len is not None else 64
    spec = LoadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=output_len,
                    range_ratio=args.range_ratio, request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency, num_warmups=args.num_warmups, seed=args.seed)
    token = None
    if args.auth_token_file:
        from meshserve.api.auth import read_token

        token = read_token(args.auth_token_file)
    json_path, png_path = _default_paths(args)
    for path in (json_path, png_path):
        if path is not None and not path.parent.is_dir():
            print(f"meshserve bench: error: {path.parent} is not a folder (for {path.name})", file=sys.stderr)
            return 2
    try:
        model, samples, wall = asyncio.run(_run(args, spec, token))
    except ServerUnreachable as exc:
        print(f"meshserve bench: error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(samples, wall)
    print(table(summary, backend=args.backend, model=model, spec=spec))
    if json_path is not None:
        write_json(json_path, summary=summary, spec=spec, backend=args.backend, model=model, samples=samples)
        print(f"results: {json_path}")
    if png_path is not None:
        try:
            plot(png_path, samples, wall, title=f"meshserve bench: {args.backend}, {model}, {summary['completed']} "
                                                f"requests, input {spec.input_len}, output {spec.output_len}")
            print(f"plot: {png_path}")
        except ImportError:
            print("plot: not written (matplotlib is not installed: pip install 'meshserve[bench]')")
    return 0 if summary["failed"] == 0 else 1
