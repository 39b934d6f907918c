"""The phase-split backend (prefill on one backend, decode on another, over one cache) against the
float64 oracle on the shared scenario table, and its composition rules."""

import dataclasses

import pytest
import torch

from meshserve.attention.backends.phase_split import PhaseSplitBackend, PhaseSplitPlan, phase_split_backend
from meshserve.attention.metadata import AttentionMetadata, split_prefill_decode
from meshserve.attention.registry import load_backend, select_backend, select_backend_for_layers
from meshserve.errors import ConfigError, NoBackendError
from tests.unit.attention.scenarios import SCENARIOS, assert_matches, make_case, oracle, run_backend

PAIRS = [("TORCH", "TRITON"), ("TRITON", "TORCH"), ("CPU_SDPA", "TRITON"), ("TRITON", "CPU_SDPA")]


def _split(prefill: str, decode: str) -> type[PhaseSplitBackend]:
    return phase_split_backend(load_backend(prefill), load_backend(decode))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}+{p[1]}")
def test_scenario(scenario, pair):
    """Every scenario both halves serve (mixed steps, chunks, windows, sinks, FP8) matches the
    oracle; one either half refuses is refused by the split, with the phase named."""
    cls = _split(*pair)
    problem = scenario.problem("float32", needs_lse=True)
    refusals = {
        phase: load_backend(name).validate_configuration(problem) for phase, name in zip(("prefill", "decode"), pair)
    }
    reasons = cls.validate_configuration(problem)
    if any(refusals.values()):
        assert reasons and all(r.startswith(("prefill backend", "decode backend")) for r in reasons)
        return
    assert reasons == []
    case = make_case(scenario, dtype=torch.float32)
    ref_out, ref_lse = oracle(case)
    out, lse = run_backend(cls, case)
    assert out.shape == ref_out.shape and lse.dtype == torch.float32
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


def test_each_phase_runs_on_its_own_backend(monkeypatch):
    """A mixed step: the prefill rows go to the prefill backend with the prefill part's metadata,
    the decode rows to the decode backend; outputs come back in batch order."""
    cls = _split("TORCH", "TRITON")
    case = make_case(next(s for s in SCENARIOS if s.name == "mixed_prefill_decode"))
    backend = cls(case.scenario.problem("float32"))
    seen = {}

    def spy(part, phase):
        real = part.forward

        def forward(query, key, value, kv_cache, plan, **kw):
            seen[phase] = (query.shape[0], plan)
            return real(query, key, value, kv_cache, plan, **kw)

        monkeypatch.setattr(part, "forward", forward)

    spy(backend.prefill, "prefill")
    spy(backend.decode, "decode")
    plan = backend.plan(case.metadata)
    assert isinstance(plan, PhaseSplitPlan)
    backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping, plan=plan)
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan, layer=case.layer)
    meta = case.metadata
    assert seen["prefill"][0] == meta.num_prefill_tokens and seen["prefill"][1] is plan.prefill_plan
    assert seen["decode"][0] == meta.num_decodes and seen["decode"][1] is plan.decode_plan
    assert out.shape[0] == meta.num_tokens
    ref, _ = oracle(case)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_one_phase_steps_plan_only_their_backend():
    cls = _split("TORCH", "TRITON")
    decode_only = make_case(next(s for s in SCENARIOS if s.name == "small_decode"))
    backend = cls(decode_only.scenario.problem("float32"))
    plan = backend.plan(decode_only.metadata)
    assert plan.prefill_plan is None and plan.decode_plan is not None
    prefill_only = make_case(next(s for s in SCENARIOS if s.name == "encoder"))
    plan = _split("TRITON", "TORCH")(prefill_only.scenario.problem("float32")).plan(prefill_only.metadata)
    assert plan.decode_plan is None and plan.prefill_plan is not None


def test_split_metadata_slices_host_tables():
    """Each part's host block table is its own rows (FLASHINFER plans from the host table)."""
    meta = AttentionMetadata.build(query_lens=[5, 3, 1, 1], seq_lens=[5, 20, 40, 17],
                                   block_tables=[[1], [2, 3], [4, 5, 6], [7, 8]], block_size=16)  # fmt: skip
    prefill, decode = split_prefill_decode(meta)
    assert prefill.block_tables_host.tolist() == meta.block_tables_host[:2].tolist()
    assert decode.block_tables_host.tolist() == meta.block_tables_host[2:].tolist()
    assert decode.query_start_loc.tolist() == [0, 1, 2]
    assert decode.slot_mapping.tolist() == meta.slot_mapping[8:].tolist()
    assert prefill.num_decodes == 0 and decode.num_prefills == 0 and decode.max_seq_len == 40


def test_capabilities_are_what_both_serve():
    triton, torch_ref = load_backend("TRITON"), load_backend("TORCH")
    caps = _split("TORCH", "TRITON").capabilities
    assert caps.dtypes == triton.capabilities.dtypes & torch_ref.capabilities.dtypes
    assert caps.min_block_size == max(triton.capabilities.min_block_size, torch_ref.capabilities.min_block_size)
    assert caps.returns_lse and caps.dcp == (triton.capabilities.dcp and torch_ref.capabilities.dcp)
    # decode graphs run decode steps only: the decode backend's word counts
    assert _split("TORCH", "TRITON").capabilities.cuda_graphs == triton.capabilities.cuda_graphs
    assert _split("TRITON", "TORCH").capabilities.cuda_graphs == torch_ref.capabilities.cuda_graphs
    assert _split("TRITON", "CPU_SDPA").fused_kv_write is (
        triton.fused_kv_write and load_backend("CPU_SDPA").fused_kv_write
    )
    assert _split("TORCH", "TRITON").fused_kv_write is False  # TORCH writes by its own scatter


def test_names_and_registry_spelling():
    cls = load_backend("prefill=torch, decode=Triton")
    assert cls is _split("TORCH", "TRITON")  # one class per pair
    assert cls.name == "TORCH prefill + TRITON decode" and cls.spelling == "prefill=TORCH,decode=TRITON"
    assert load_backend("decode=TRITON,prefill=TRITON") is load_backend("TRITON")  # one name: no split
    scenario = next(s for s in SCENARIOS if s.name == "small_decode")
    assert select_backend(scenario.problem(), "prefill=TORCH,decode=TRITON") is cls
    assert select_backend_for_layers([scenario.problem(), SCENARIOS[6].problem()], "prefill=TORCH,decode=TRITON") is cls


@pytest.mark.parametrize(
    "bad",
    [
        "prefill=TRITON",
        "prefill=TRITON,decode=NOPE",
        "prefill=A,decode=B,x=C",
        "prefil=TRITON,decode=TORCH",
        "prefill=TRITON,prefill=TORCH",
        "TRITON,TORCH",
    ],
)
def test_bad_split_names_the_field(bad):
    with pytest.raises(ConfigError, match="attention_backend") as err:
        load_backend(bad)
    assert "prefill=NAME,decode=NAME" in str(err.value)


def test_a_half_that_cannot_serve_is_named():
    problem = dataclasses.replace(SCENARIOS[0].problem(), device="cuda", compute_capability=(9, 0))
    with pytest.raises(NoBackendError, match="decode backend CPU_SDPA: device 'cuda' not supported"):
        select_backend(problem, "prefill=TRITON,decode=CPU_SDPA")


def test_graph_plan_and_replay_go_to_the_decode_backend(monkeypatch):
    cls = _split("TORCH", "TRITON")
    case = make_case(next(s for s in SCENARIOS if s.name == "small_decode"))
    backend = cls(case.scenario.problem("float32"))
    meta = dataclasses.replace(case.metadata, seq_lens_host=(case.scenario.max_model_len,) * case.metadata.num_seqs)
    plan = backend.plan_for_graph(meta)
    assert plan.prefill_plan is None and type(plan.decode_plan).__name__ == "TritonPlan"
    calls = []
    monkeypatch.setattr(backend.decode, "prepare_replay", lambda p, s, t: calls.append(p))
    backend.prepare_replay(plan, None, None)
    assert calls == [plan.decode_plan]
    backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping, plan=plan)
    out, lse = backend.forward(case.query, case.key, case.value, case.kv_cache, plan, layer=case.layer, return_lse=True)
    ref_out, ref_lse = oracle(case)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


def test_cli_shows_a_named_split(capsys):
    from meshserve.cli import main

    flags = ["backends", "--quiet", "--device", "cuda", "--compute-capability", "9.0", "--head-size", "128"]
    assert main([*flags, "--attention-backend", "prefill=TORCH,decode=TRITON"]) == 0
    out = capsys.readouterr().out
    assert "prefill=TORCH,decode=TRITON valid" in out and "Selected: TORCH prefill + TRITON decode (named)" in out


def test_cli_shows_a_measured_split_and_why(capsys, monkeypatch):
    from meshserve.attention import kernel_choice
    from meshserve.attention.kernel_choice import parse_table
    from meshserve.cli import main

    source = {"command": "test", "date": "2026-12-06", "device": "test"}
    key = dict(kind="attention", attention="GQA", kv="bfloat16", capability="9.0", page_size=16)
    table = parse_table({"entries": [
        key | dict(phase="prefill", fastest="TORCH", relative={"TORCH": 1.0, "TRITON": 1.4}, source=source),
        key | dict(phase="decode", fastest="TRITON", relative={"TORCH": 1.3, "TRITON": 1.0}, source=source),
    ]})  # fmt: skip
    monkeypatch.setattr(kernel_choice, "load_table", lambda: table)
    assert main(["backends", "--quiet", "--device", "cuda", "--compute-capability", "9.0", "--head-size", "128"]) == 0
    selected = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Selected"))
    assert selected.startswith("Selected: TORCH prefill + TRITON decode (table: ")
    assert "phase split prefill TORCH + decode TRITON (decode: TRITON 1.300x faster than TORCH" in selected
