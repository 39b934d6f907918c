"""bench/attention_choice.py: its table writing, on hand-made timings (the timing itself needs a
GPU), and its batches and reference checks on the CPU (TRITON under the interpreter, toy sizes).

The entries it writes must parse as a kernel-choice table, name the fastest of the backends that
passed the reference check (a dropped backend never wins, even with the smallest time), and
replace the entry of the same class when merged into an existing table. Its prefill steps must
hand forward the step's own K/V, equal to what the cache holds, as the engine's layers do.
"""

import json

import pytest
import torch

from bench.attention_choice import (
    CHECK_BATCHES,
    PREFILL_SHAPES,
    ProblemClassSpec,
    Result,
    Rig,
    check_gqa,
    entries,
    gqa_batch,
    gqa_run,
    merge,
    relative_times,
    shape_label,
)
from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernel_choice import TABLE_PATH, parse_table
from meshserve.attention.kernels.config import PrefillConfig
from meshserve.attention.registry import load_backend

CPU = Rig(device="cpu", dtype=torch.float16, heads=4, kv_heads=2, head=32)

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
    decode16 = [e for e in parsed if (e.key.phase, e.key.attention, e.key.kv, e.key.page_size, e.key.size)
                == ("decode", "GQA", "bfloat16", 16, "any")]  # fmt: skip
    assert len(decode16) == 1 and decode16[0].fastest == "TRITON"
    assert len(parsed) == len(shipped["entries"])  # replaced, not added


@pytest.mark.parametrize("kv,phase", [("bf16", "prefill"), ("fp8", "prefill"), ("bf16", "decode")])
def test_triton_passes_the_benchs_reference_checks_on_cpu(kv, phase):
    """Every check batch of the phase (prefill: a chunk over cached context beside a fresh
    prompt, and fresh prompts only) through TRITON against TORCH, as the GPU run does first."""
    assert check_gqa(ProblemClassSpec("gqa", kv, 16), "TRITON", phase, CPU) is None


def test_prefill_hands_forward_the_steps_kv_equal_to_the_cache():
    """A fresh prompt's tiles read the K/V forward is given (fresh_kv tiles, forced on here: CPU
    defaults have none): they must be the cache's rows, and the bench must pass them. The fresh
    prompt's cache rows are NaN by the time forward runs: reading the pages instead would show."""
    cls = ProblemClassSpec("gqa", "bf16", 16)
    prob = cls.problem(2048, CPU)
    query_lens, seq_lens = CHECK_BATCHES["prefill"]["chunk over cached context + fresh prompt"]
    batch = gqa_batch(cls, query_lens, seq_lens, seed=3, rig=CPU)
    ref_out, ref_lse = gqa_run(load_backend("TORCH")(prob), batch)()
    fresh = PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, kv_desc=True, fresh_kv=True)
    triton = TritonBackend(prob, prefill_config=fresh)
    assert set(triton.plan(batch.meta).fresh_tile_seq.tolist()) == {1}  # the 64-token prompt
    run = gqa_run(triton, batch)
    blocks = batch.meta.block_table[1, : seq_lens[1] // cls.page].long()
    batch.cache.data[blocks] = float("nan")
    out, lse = run()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


def test_prefill_shapes_hold_fresh_prompts_and_chunks_over_cached_context():
    labels = [shape_label("prefill", s) for s in PREFILL_SHAPES]
    assert "prefill 4x4096" in labels and any("+" in label for label in labels)
    assert shape_label("decode", (64, 4096)) == "decode 64x4096"


def test_short_context_decode_is_its_own_class():
    """Standard classes measure decode at size "any" and, on short contexts, at size "short"; the
    short entry is written with its size, merges beside the "any" one (not over it), and is the
    decode entry a server of max_model_len <= LONG_CONTEXT reads."""
    from bench.attention_choice import DECODE_SHAPES, DECODE_SHORT_SHAPES, gqa_shapes
    from meshserve.attention.backend import AttentionProblem
    from meshserve.attention.kernel_choice import LONG_CONTEXT, choose
    from meshserve.attention.spec import AttentionSpec

    cls = ProblemClassSpec("gqa", "bf16", 16)
    assert ("attention", "decode", "short") in cls.kinds() and ("attention", "decode", "any") in cls.kinds()
    assert gqa_shapes("decode", "short") == DECODE_SHORT_SHAPES and gqa_shapes("decode", "any") == DECODE_SHAPES
    assert max(keys for _, keys in DECODE_SHORT_SHAPES) <= LONG_CONTEXT
    r = Result(cls, "attention", "decode", size="short",
               times_us={"TRITON": {"decode 256x160": 77.0}, "FLASHINFER": {"decode 256x160": 100.0}})  # fmt: skip
    (e,) = entries([r], **STAMP)
    assert e["size"] == "short" and e["id"].endswith("-short")
    shipped = json.loads(TABLE_PATH.read_text())
    parsed = parse_table(merge(shipped, [e]))
    assert len(parsed) == len(shipped["entries"]) + 1  # beside the "any" decode entry
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128)
    short = AttentionProblem(spec=spec, dtype="bfloat16", block_size=16, max_model_len=4096, device="cuda",
                             compute_capability=(9, 0))  # fmt: skip
    choice = choose(short, "attention", ("FLASHINFER", "TRITON"), parsed)
    assert [x.key.size for x in choice.entries] == ["any", "short"]
    # FLASHINFER prefill 1.427x faster, TRITON short decode 1.30x faster: the split
    assert choice.split == ("FLASHINFER", "TRITON")
    long = AttentionProblem(**(vars(short) | {"max_model_len": 4 * LONG_CONTEXT}))
    assert choose(long, "attention", ("FLASHINFER", "TRITON"), parsed).split is None  # the "any" decode entry


def test_only_names_the_measurements_of_a_class():
    from bench.attention_choice import MEASUREMENTS, measurement_name, parse_only

    cls = ProblemClassSpec("gqa", "fp8", 64)
    assert {measurement_name(phase, size) for _, phase, size in cls.kinds()} == set(MEASUREMENTS)
    assert parse_only("decode-short") == {"decode-short"} and parse_only(None) is None
    with pytest.raises(SystemExit, match="--only"):
        parse_only("decode-long")


def test_mha_is_a_class_of_its_own_that_an_mha_problem_reads():
    """MHA (as many K/V heads as query heads) is measured as its own class: its cache and batches
    carry a K/V head per query head, TRITON passes its checks against TORCH, and its entries are
    the ones kernel_choice gives an MHA problem, while a GQA problem keeps the GQA entries."""
    from meshserve.attention.backend import AttentionProblem
    from meshserve.attention.kernel_choice import choose
    from meshserve.attention.spec import AttentionSpec

    cls = ProblemClassSpec.parse("mha-bf16-16")
    assert cls.problem(2048, CPU).spec.num_kv_heads == CPU.heads
    batch = gqa_batch(cls, (1, 1), (40, 7), seed=1, rig=CPU)
    assert batch.cache.data.shape[-2] == CPU.heads and batch.key.shape[1] == CPU.heads
    assert check_gqa(cls, "TRITON", "decode", CPU) is None
    rs = [Result(cls, "attention", phase, times_us={"TRITON": {"s": 80.0}, "FLASHINFER": {"s": 100.0}})
          for phase in ("prefill", "decode")]  # fmt: skip
    made = entries(rs, **STAMP)
    assert {e["attention"] for e in made} == {"MHA"} and all("-mha-" in e["id"] for e in made)
    parsed = parse_table(merge(json.loads(TABLE_PATH.read_text()), made))

    def first(kv_heads: int) -> str:
        problem = AttentionProblem(AttentionSpec(32, kv_heads, 128), dtype="bfloat16", block_size=16,
                                   max_model_len=1 << 17, device="cuda", compute_capability=(9, 0))  # fmt: skip
        return choose(problem, "attention", ("FLASHINFER", "TRITON"), parsed).order[0]

    assert (first(32), first(8)) == ("TRITON", "FLASHINFER")
