"""`meshserve bench`: load a running `meshserve serve` (or any OpenAI-compatible server) and report.

    meshserve bench --backend openai --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \\
        --input-len 128 --output-len 64 --result-json run.json --plot run.png
    meshserve bench --backend grpc --address 127.0.0.1:50051 --max-concurrency 16 --range-ratio 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import math


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="serving benchmark against a running server (gRPC or OpenAI HTTP): "
                                            "TTFT, TPOT, ITL percentiles, throughputs, JSON and PNG")
    t = p.add_argument_group("the server")
    t.add_argument("--backend", default="openai", choices=["openai", "grpc"],
                   help="openai: POST /v1/completions (SSE); grpc: meshserve.v1.Inference/Generate")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="the OpenAI API's root (openai backend)")
    t.add_argument("--address", default="127.0.0.1:50051", help="host:port (grpc backend)")
    t.add_argument("--model", default="", help="model name (default: the server's first)")
    t.add_argument("--auth-token-file", default=None, help="file holding the server's bearer token")
    w = p.add_argument_group("the load")
    w.add_argument("--num-prompts", type=int, default=100, help="measured requests")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    w.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths")
    w.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: at once)")
    w.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    w.add_argument("--num-warmups", type=int, default=2, help="requests sent first and not counted")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None, help="write the summary and every request's timings here")
    o.add_argument("--plot", default=None, help="write a PNG: latency CDFs and throughput over time")
    p.set_defaults(func=bench_main)
    return p


async def _run(args, spec, token):
    from meshserve.api.bench.loadgen import GrpcBackend, OpenAIBackend, run_load

    if args.backend == "grpc":
        backend = GrpcBackend(args.address, token=token, model=args.model)
    else:
        backend = OpenAIBackend(args.base_url, token=token, model=args.model)
    try:
        model, vocab_size, _ = await backend.model_info()
        backend.model = model
        samples, wall = await run_load(backend, spec, vocab_size=vocab_size)
    finally:
        await backend.close()
    return model, samples, wall


def bench_main(args: argparse.Namespace) -> int:
    from meshserve.api.bench.loadgen import LoadSpec
    from meshserve.api.bench.report import plot, summarize, table, write_json

    spec = LoadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                    range_ratio=args.range_ratio, request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency, num_warmups=args.num_warmups, seed=args.seed)
    token = None
    if args.auth_token_file:
        from meshserve.api.auth import read_token

        token = read_token(args.auth_token_file)
    model, samples, wall = asyncio.run(_run(args, spec, token))
    summary = summarize(samples, wall)
    print(table(summary, backend=args.backend, model=model, spec=spec))
    if args.result_json:
        write_json(args.result_json, summary=summary, spec=spec, backend=args.backend, model=model, samples=samples)
    if args.plot:
        plot(args.plot, samples, wall, title=f"meshserve bench: {args.backend}, {model}, {summary['completed']} "
                                             f"requests, input {spec.input_len}, output {spec.output_len}")
    return 0 if summary["failed"] == 0 else 1
