"""`meshserve embed --model DIR TEXT...`: one JSON line per input, in order, on stdout.

Each line is {"index": i, "num_tokens": n, "embedding": [float, ...]} (float32 values). With
"-" as the only text the inputs are read from stdin, one per line. Inputs longer than the
model's limit are refused (exit status 2, the limit named) unless --truncate.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshserve.errors import check


def add_embed_parser(subparsers) -> argparse.ArgumentParser:
    """Register `embed` on the CLI's subparsers; the parsed args go to `embed_main`."""
    p = subparsers.add_parser("embed", help="embed texts with an encoder-only model; JSON lines to stdout")
    p.add_argument("texts", nargs="+", help="texts to embed ('-': read one text per line from stdin)")
    p.add_argument("--model", required=True, help="checkpoint directory of an embedding model (e.g. BertModel)")
    p.add_argument("--truncate", action="store_true", help="cut inputs longer than the model's limit")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--attention-backend", default=None, help="TORCH, TRITON, FLASHINFER (default: automatic)")
    p.add_argument("--block-size", type=int, default=None, help="default: naive layout (== max model len)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens packed into one forward")
    p.set_defaults(func=embed_main)
    return p


def embed_main(args: argparse.Namespace) -> int:
    from meshserve.api.llm import LLM

    texts = args.texts
    if texts == ["-"]:
        texts = [line.rstrip("\n") for line in sys.stdin]
    check(len(texts) >= 1, "texts", texts, "at least one text")
    llm = LLM(args.model, dtype=args.dtype, attention_backend=args.attention_backend, block_size=args.block_size,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              device=args.device, progress=False)
    try:
        outs = llm.embed(texts, truncate=args.truncate)
    finally:
        llm.shutdown()
    for i, out in enumerate(outs):
        line = {"index": i, "num_tokens": out.num_tokens, "embedding": out.embedding.tolist()}
        sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    return 0
