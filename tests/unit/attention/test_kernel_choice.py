"""The kernel-choice table (meshserve/attention/kernel_choice.json) and the registry's use of it.

The shipped table must parse and name registered backends only; the registry, asked with a
fake compute capability, must follow a table's measured order (real registry code, real
validation: a backend that cannot serve the problem is still passed over), and fall back to its
priority list where the table has no entry for a phase, and always on CPU.
"""

from __future__ import annotations

import copy
import json

import pytest

from meshserve.attention import kernel_choice
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.kernel_choice import PHASES_OF_KIND, TABLE_PATH, choose, load_table, parse_table
from meshserve.attention.mla.spec import mla_spec
from meshserve.attention.registry import BackendKind, default_order, explain, select_backend, tables
from meshserve.attention.spec import AttentionSpec, KVCacheDtype, MLADims
from meshserve.errors import ConfigError

SOURCE = {"command": "python3 -m bench.attention_choice", "date": "2026-12-05", "device": "test"}


def gqa(*, page: int = 16, kv: KVCacheDtype = KVCacheDtype.AUTO, device: str = "cuda",
        cc: tuple[int, int] | None = (9, 0)) -> AttentionProblem:  # fmt: skip
    return AttentionProblem(spec=AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, kv_cache_dtype=kv),
                            dtype="float32", block_size=page, max_model_len=1024, device=device,
                            compute_capability=cc)  # fmt: skip


def entry(phase: str, relative: dict[str, float], **key) -> dict:
    base = dict(kind="attention", phase=phase, attention="GQA", kv="float32", capability="9.0", page_size=16)
    return base | key | dict(fastest=min(relative, key=relative.get), relative=relative, source=SOURCE)


@pytest.fixture
def table(monkeypatch):
    """Install a table of entries (dicts) in place of the shipped one, for the registry to read."""
    def install(*entries):
        parsed = parse_table({"entries": list(entries)})
        monkeypatch.setattr(kernel_choice, "load_table", lambda: parsed)
        return parsed
    return install


def test_shipped_table_parses_and_names_registered_backends_only():
    entries = load_table()
    assert entries, "the table is seeded with the measurements in docs/performance.md"
    for e in entries:
        backends, _ = tables(e.key.kind)
        assert set(e.relative) <= set(backends), (e.id, sorted(e.relative))
        assert e.fastest in backends and e.key.phase in PHASES_OF_KIND[e.key.kind]
        assert e.source["command"] and e.source["date"] and e.source["device"]
    assert len({e.id for e in entries}) == len(entries)


def test_shipped_seed_gives_flashinfer_for_hopper_bf16_gqa_at_pages_of_16():
    problem = AttentionProblem(spec=AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128), dtype="bfloat16",
                               block_size=16, max_model_len=8192, device="cuda", compute_capability=(9, 0))
    choice = default_order(problem)
    assert choice.from_table and choice.order[0] == "FLASHINFER"
    assert {e.key.phase for e in choice.entries} == {"prefill", "decode"}
    dims = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    mla = AttentionProblem(spec=mla_spec(128, dims), dtype="bfloat16", block_size=64, max_model_len=8192,
                           device="cuda", compute_capability=(9, 0))
    assert default_order(mla, BackendKind.MLA_DECODE).order[0] == "FLASHINFER"


def test_registry_follows_the_measured_order(table):
    # TRITON validates for this problem (the fallback's first valid choice); the table says TORCH is faster.
    assert select_backend(gqa()).name == "TRITON"
    table(entry("prefill", {"TORCH": 1.0, "TRITON": 2.0}), entry("decode", {"TORCH": 1.0, "TRITON": 1.5}))
    assert default_order(gqa()).order[:2] == ("TORCH", "TRITON")
    assert select_backend(gqa()).name == "TORCH"


def test_a_phase_without_an_entry_falls_back_to_the_priority_list(table):
    table(entry("prefill", {"TORCH": 1.0, "TRITON": 2.0}))  # no decode measurement
    choice = default_order(gqa())
    assert not choice.from_table and "no measurement for attention decode" in choice.reason
    assert select_backend(gqa()).name == "TRITON"
    assert select_backend(gqa(page=32)).name == "TRITON"  # other page size: no entry at all


def test_the_phases_are_weighed_together(table):
    # TRITON wins decode by a little, TORCH wins prefill by a lot: TORCH loses less overall.
    table(entry("prefill", {"TORCH": 1.0, "TRITON": 1.9}), entry("decode", {"TORCH": 1.1, "TRITON": 1.0}))
    assert default_order(gqa()).order[0] == "TORCH"


def test_a_measured_backend_that_cannot_serve_is_passed_over(table):
    # FLASHINFER is not installed here (or refuses float32): measured fastest, still refused.
    table(entry("prefill", {"FLASHINFER": 1.0, "TRITON": 1.2, "TORCH": 3.0}),
          entry("decode", {"FLASHINFER": 1.0, "TRITON": 1.1, "TORCH": 3.0}))  # fmt: skip
    assert default_order(gqa()).order[0] == "FLASHINFER"
    assert select_backend(gqa()).name == "TRITON"


def test_cpu_and_other_capabilities_are_unaffected(table):
    table(entry("prefill", {"TORCH": 1.0, "TRITON": 2.0}), entry("decode", {"TORCH": 1.0, "TRITON": 2.0}))
    cpu = gqa(device="cpu", cc=None)
    assert "not a CUDA problem" in default_order(cpu).reason
    assert select_backend(cpu).name == "CPU_SDPA"
    assert not default_order(gqa(cc=(8, 0))).from_table
    assert not default_order(gqa(kv=KVCacheDtype.FP8_E4M3)).from_table  # kv class fp8, not float32


def test_most_specific_entry_wins():
    entries = parse_table({"entries": [
        entry("decode", {"TORCH": 1.0, "TRITON": 2.0}, kind="mla_decode", attention="MLA", page_size=None),
        entry("decode", {"TORCH": 2.0, "TRITON": 1.0}, kind="mla_decode", attention="MLA", page_size=64),
    ]})  # fmt: skip
    dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    mla = AttentionProblem(spec=mla_spec(4, dims), dtype="float32", block_size=64, max_model_len=1024,
                           device="cuda", compute_capability=(9, 0))
    fallback = ("TRITON", "TORCH")
    assert choose(mla, "mla_decode", fallback, entries).order[0] == "TRITON"
    other_page = AttentionProblem(**(vars(mla) | {"block_size": 16}))
    assert choose(other_page, "mla_decode", fallback, entries).order[0] == "TORCH"


@pytest.mark.parametrize(("field", "value", "named"), [
    ("kind", "flash", "kind"),
    ("phase", "both", "phase"),
    ("attention", "MQA", "attention"),
    ("kv", "int8", "kv"),
    ("capability", "sm90", "capability"),
    ("page_size", 0, "page_size"),
    ("relative", {"TRITON": 0.5}, "relative"),
    ("fastest", "TORCH", "fastest"),
    ("source", {"date": "x"}, "source"),
])  # fmt: skip
def test_a_bad_entry_is_refused_naming_its_field(field, value, named):
    raw = json.loads(TABLE_PATH.read_text())
    bad = copy.deepcopy(raw)
    bad["entries"][0][field] = value
    with pytest.raises(ConfigError, match=rf"entries\[0\]\.{named}"):
        parse_table(bad)


# ----------------------------------------------------------------------------- phase split
def test_per_phase_winners_apart_by_more_than_the_margin_split(table):
    # TORCH wins the sum (prefill by a lot); TRITON's decode is 1.30x TORCH's: split.
    table(entry("prefill", {"TORCH": 1.0, "TRITON": 1.43}), entry("decode", {"TORCH": 1.30, "TRITON": 1.0}))
    choice = default_order(gqa())
    assert choice.order[0] == "TORCH" and choice.split == ("TORCH", "TRITON")
    assert "phase split prefill TORCH + decode TRITON" in choice.reason and "1.300x" in choice.reason
    chosen = select_backend(gqa())
    assert chosen.name == "TORCH prefill + TRITON decode"
    assert explain(gqa())[0].name == "prefill=TORCH,decode=TRITON"


def test_per_phase_winners_apart_by_less_than_the_margin_do_not_split(table):
    assert kernel_choice.SPLIT_MIN_GAIN == 1.05
    table(entry("prefill", {"TORCH": 1.0, "TRITON": 1.43}), entry("decode", {"TORCH": 1.04, "TRITON": 1.0}))
    choice = default_order(gqa())
    assert choice.split is None and "no phase split" in choice.reason
    assert select_backend(gqa()).name == "TORCH"


def test_the_margin_applies_to_a_prefill_winner_too(table):
    table(entry("prefill", {"TORCH": 1.2, "TRITON": 1.0}), entry("decode", {"TORCH": 1.0, "TRITON": 1.5}))
    assert default_order(gqa()).split == ("TRITON", "TORCH")


def test_a_split_whose_half_cannot_serve_is_passed_over(table):
    # FLASHINFER cannot serve here (not installed, or float32): the split is refused, the order applies.
    table(entry("prefill", {"FLASHINFER": 1.0, "TRITON": 1.4}), entry("decode", {"FLASHINFER": 1.3, "TRITON": 1.0}))
    choice = default_order(gqa())
    assert choice.split == ("FLASHINFER", "TRITON")
    verdicts = {v.name: v for v in explain(gqa())}
    assert not verdicts["prefill=FLASHINFER,decode=TRITON"].ok
    assert any(r.startswith("prefill backend FLASHINFER") for r in verdicts["prefill=FLASHINFER,decode=TRITON"].reasons)
    assert select_backend(gqa()).name == "TRITON"


def test_other_kinds_never_split(table):
    dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    mla = AttentionProblem(spec=mla_spec(4, dims), dtype="float32", block_size=16, max_model_len=1024,
                           device="cuda", compute_capability=(9, 0))  # fmt: skip
    entries = parse_table({"entries": [
        entry("prefill", {"TORCH": 1.0, "TRITON": 1.5}, kind="mla_sparse", attention="MLA"),
        entry("decode", {"TORCH": 1.5, "TRITON": 1.0}, kind="mla_sparse", attention="MLA"),
    ]})  # fmt: skip
    assert choose(mla, "mla_sparse", ("TRITON", "TORCH"), entries).split is None


def _shipped_attention_problems():
    """One problem per (kv, page) class of the shipped attention entries, short and long."""
    for e in load_table():
        if e.key.kind != "attention":
            continue
        kv = KVCacheDtype.FP8_E4M3 if e.key.kv == "fp8" else KVCacheDtype.AUTO
        dtype = "bfloat16" if e.key.kv == "fp8" else e.key.kv
        major, minor = map(int, e.key.capability.split("."))
        for max_len in (4096, 32768):
            yield AttentionProblem(spec=AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, kv_cache_dtype=kv),
                                   dtype=dtype, block_size=e.key.page_size or 16, max_model_len=max_len,
                                   device="cuda", compute_capability=(major, minor))  # fmt: skip


def test_the_shipped_table_splits_nowhere():
    """Today's measurements (FLASHINFER vs TRITON decode within 1.006..1.015) must not split."""
    problems = list(dict.fromkeys(_shipped_attention_problems()))
    assert len(problems) >= 8
    for problem in problems:
        choice = default_order(problem)
        assert choice.from_table, problem
        assert choice.split is None, (problem, choice.reason)
