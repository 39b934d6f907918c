"""Where to compile a grammar: on a thread of the driver, or in a child process that can be killed.

A compile in xgrammar's C++ cannot be interrupted on a thread; a child process can be killed. This
measures what the process would cost every normal compile: per (vocabulary, schema), the median
of `--repeats` compiles (xgrammar's cache off) on a thread, against a round trip to a spawned
child that holds the same TokenizerInfo: the spec out as msgpack over a pipe, the child compiles
and answers `CompiledGrammar.serialize_json()`, the parent `deserialize_json`s it against its own
TokenizerInfo (parts timed apart). Vocabularies: the demo model's tokenizer (4,096 tokens) and a
128k-entry WordLevel one (bench/wordlevel_tokenizer.py). The decision it informed is in
docs/structured_outputs.md ("A compile past the bound").

Prints a table, writes JSON and a PNG (bench/results/grammar_compile_paths[-TAG].{json,png}).

    python -m bench.grammar_compile_paths
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import msgpack

from bench.report import pyplot, save_figure
from bench.wordlevel_tokenizer import write_wordlevel_tokenizer
from meshserve.demo_model import DEMO_MODEL_DIR

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
LARGE = {  # 60 typed fields (half required) and an array of objects with a pattern, a minimum and an enum
    "type": "object",
    "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(60)} | {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
            "qty": {"type": "integer", "minimum": 1}, "kind": {"enum": ["a", "b", "c", "d"]}},
            "required": ["sku", "qty"]}}},
    "required": [f"field_{i}" for i in range(0, 60, 2)]}
SCHEMAS = {"person (typical)": PERSON, "large (60 fields)": LARGE}


def _tokenizer_info(tokenizer_dir: Path, vocab_size: int | None):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size or len(tok), stop_token_ids=[1])


def _child(conn, info_json: str) -> None:
    """The compile process: TokenizerInfo once, then msgpack {"schema"} -> the compiled grammar's JSON."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1, cache_enabled=False)
    while True:
        msg = msgpack.unpackb(conn.recv_bytes())
        if msg is None:
            return
        t = time.perf_counter()
        compiled = compiler.compile_grammar(xgr.Grammar.from_json_schema(msg["schema"]))
        t_compile = time.perf_counter() - t
        out = compiled.serialize_json()
        conn.send_bytes(msgpack.packb({"json": out, "compile_s": t_compile,
                                       "serialize_s": time.perf_counter() - t - t_compile}))


def measure(info, schema: dict, repeats: int) -> dict:
    import xgrammar as xgr

    text = json.dumps(schema)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    thread = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiler.compile_grammar(xgr.Grammar.from_json_schema(text))
        thread.append(time.perf_counter() - t)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    t = time.perf_counter()
    child = ctx.Process(target=_child, args=(there, info.serialize_json()), daemon=True)
    child.start()
    here.send_bytes(msgpack.packb({"schema": text}))  # the first round trip includes the child's start
    here.recv_bytes()
    start_s = time.perf_counter() - t
    rows = []
    for _ in range(repeats):
        t = time.perf_counter()
        here.send_bytes(msgpack.packb({"schema": text}))
        reply = msgpack.unpackb(here.recv_bytes())
        t_reply = time.perf_counter()
        compiled = xgr.CompiledGrammar.deserialize_json(reply["json"], info)
        t_end = time.perf_counter()
        rows.append((t_end - t, reply["compile_s"], reply["serialize_s"], t_end - t_reply, len(reply["json"])))
    here.send_bytes(msgpack.packb(None))
    child.join(10)
    del compiled

    def med(i):
        return 1e3 * statistics.median(r[i] for r in rows)

    return {"thread_ms": 1e3 * statistics.median(thread), "process_ms": med(0), "child_compile_ms": med(1),
            "serialize_ms": med(2), "deserialize_ms": med(3), "json_kb": rows[0][4] / 1e3,
            "child_start_s": start_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_wordlevel_tokenizer(tmp, 128_000, bos_token_id=0, eos_token_id=1)
        for vocab, (tdir, size) in {"demo 4k": (DEMO_MODEL_DIR, None), "WordLevel 128k": (Path(tmp), 128_000)}.items():
            info = _tokenizer_info(Path(tdir), size)
            for name, schema in SCHEMAS.items():
                rows.append({"vocab": vocab, "schema": name, **measure(info, schema, args.repeats)})
    print(f"{'vocabulary':>15}{'schema':>19}{'thread ms':>11}{'process ms':>12}{'x':>7}{'serialize':>11}"
          f"{'deserialize':>13}{'JSON kB':>9}{'child start s':>15}")
    for r in rows:
        print(f"{r['vocab']:>15}{r['schema']:>19}{r['thread_ms']:>11.2f}{r['process_ms']:>12.2f}"
              f"{r['process_ms'] / r['thread_ms']:>7.1f}{r['serialize_ms']:>11.2f}{r['deserialize_ms']:>13.2f}"
              f"{r['json_kb']:>9.0f}{r['child_start_s']:>15.2f}")
    out = Path(__file__).parent / "results" / f"grammar_compile_paths{'-' + args.tag if args.tag else ''}"
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['vocab']}\n{r['schema']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["thread_ms"] for r in rows], 0.4, label="compile on a thread")
    ax.bar([i + 0.2 for i in x], [r["process_ms"] for r in rows], 0.4, label="child process + JSON + deserialize")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_title("one grammar compile, by where it runs")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
