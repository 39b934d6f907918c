"""bench/attention_choice.py's table writing, on hand-made timings (the timing itself needs a GPU).

The entries it writes must parse as a kernel-choice table, name the fastest of the backends that
passed the reference check (a dropped backend never wins, even with the smallest time), and
replace the entry of the same class when merged into an existing table.
"""

import json

from bench.attention_choice import ProblemClassSpec, Result, entries, merge, relative_times
from meshserve.attention.kernel_choice import TABLE_PATH, parse_table

STAMP = dict(device="NVIDIA H200", capability="9.0", date="2026-12-05", command="python3 -m bench.attention_choice")


def test_relative_times_rank_backends_timed_on_every_shape():
    rel = relative_times({"A": {"s1": 10.0, "s2": 40.0}, "B": {"s1": 20.0, "s2": 20.0}, "C": {"s1": 1.0}})
    assert rel == {"A": 1.5, "B": 1.5}  # C missed s2: not ranked, whatever its time on s1


def test_entries_name_the_fastest_backend_that_passed_the_check():
    r = Result(ProblemClassSpec("gqa", "fp8", 64), "attention", "decode",
               times_us={"TRITON": {"decode 8x32768": 100.0}, "FLASHINFER": {"decode 8x32768": 120.0}},
               dropped={"FAST_BUT_WRONG": "output error 3.1e-01 against TORCH"})  # fmt: skip
    (e,) = entries([r], **STAMP)
    assert (e["fastest"], e["kv"], e["page_size"], e["capability"]) == ("TRITON", "fp8", 64, "9.0")
    assert e["relative"] == {"FLASHINFER": 1.2, "TRITON": 1.0}
    assert "FAST_BUT_WRONG" not in e["relative"] and "FAST_BUT_WRONG" in e["source"]["dropped"]
    parse_table({"entries": [e]})


def test_merge_replaces_the_same_class_and_keeps_the_rest():
    shipped = json.loads(TABLE_PATH.read_text())
    r = Result(ProblemClassSpec("gqa", "bf16", 16), "attention", "decode",
               times_us={"TRITON": {"s": 90.0}, "FLASHINFER": {"s": 100.0}})  # fmt: skip
    merged = merge(shipped, entries([r], **STAMP))
    parsed = parse_table(merged)
    decode16 = [e for e in parsed if (e.key.phase, e.key.kv, e.key.page_size) == ("decode", "bfloat16", 16)]
    assert len(decode16) == 1 and decode16[0].fastest == "TRITON"
    assert len(parsed) == len(shipped["entries"])  # replaced, not added
