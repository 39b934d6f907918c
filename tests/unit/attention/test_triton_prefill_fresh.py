"""TRITON prefill of "fresh" sequences (no cached context) from the step's own K/V rather than
the pages (PrefillConfig.fresh_kv; row descriptors in kernels/kv_rows.py) against the float64
oracle. CPU: the Triton interpreter emulates descriptors (tests/gpu/test_prefill_desc_gpu.py runs
the same variants on the hardware in bf16).

After write_kv, every cache slot of a fresh sequence is set to NaN (and, as in
test_triton_prefill_desc.py, every slot no sequence owns): a fresh tile that still read the pages
would show up as NaN, and a chunked sequence (cached context) or a decode row can only be right
by reading the pages.
"""

import dataclasses
import functools

import pytest
import torch

from meshserve.attention.backends.triton_paged import TritonBackend
from meshserve.attention.kernels.config import PrefillConfig
from meshserve.attention.kernels.host_plans import row_descriptor_reasons
from meshserve.attention.spec import KVCacheDtype
from tests.unit.attention.scenarios import (
    SCENARIO_BY_NAME,
    Scenario,
    assert_matches,
    forward_with_fresh_slots_poisoned,
    make_case,
    oracle,
    poison_unowned_slots,
    run_backend,
)
from tests.unit.attention.test_dcp_reference import merge_shards, shard_run


def _cfg(m, n, *, desc=True):
    return PrefillConfig(block_m=m, block_n=n, num_warps=4, num_stages=1, kv_desc=desc, fresh_kv=True)


# Two fresh prompts (0 and 2), a chunk after 100 cached tokens (1), a decode row (3); GQA 8 / 2.
MIXED = Scenario("fresh_mixed", (70, 33, 21, 1), (0, 100, 0, 60), spec=dict(num_heads=8, num_kv_heads=2))
# (page, tile): tiles spanning 2 and 4 pages of the cache (one row load each on the fresh path).
PAGE_TILES = ((16, _cfg(16, 32)), (32, _cfg(32, 64)), (64, _cfg(16, 16)))
FEATURES = ("sliding_window", "sinks", "streaming_sinks", "alibi", "softcap")


def run_fresh(case, cfg):
    """TRITON with `cfg` through forward_with_fresh_slots_poisoned: (out, lse, plan)."""
    backend = TritonBackend(case.scenario.problem(needs_lse=True), prefill_config=cfg)
    return forward_with_fresh_slots_poisoned(backend, case)


def check(scenario, cfg, *, seed=4):
    case = make_case(scenario, seed=seed)
    poison_unowned_slots(case)
    ref_out, ref_lse = oracle(case)
    out, lse, plan = run_fresh(case, cfg)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)
    return plan


def _seqs(tiles):
    return set() if tiles is None else set(tiles.tolist())


@pytest.mark.parametrize("page,cfg", PAGE_TILES, ids=lambda x: str(x) if isinstance(x, int) else f"{x.block_n}")
def test_fresh_sequences_read_the_steps_kv_and_the_others_the_pages(page, cfg):
    plan = check(dataclasses.replace(MIXED, block_size=page), cfg)
    assert _seqs(plan.fresh_tile_seq) == {0, 2} and _seqs(plan.tile_seq) == {1}
    assert plan.num_splits >= 1  # the decode row ran too


def test_fresh_prefill_by_pointers_without_descriptors():
    plan = check(MIXED, _cfg(16, 32, desc=False))
    assert _seqs(plan.fresh_tile_seq) == {0, 2}


def test_all_fresh_step_launches_no_paged_tiles():
    plan = check(Scenario("all_fresh", (45, 16, 3), (0, 0, 0), spec=dict(num_heads=8, num_kv_heads=2)), _cfg(16, 32))
    assert plan.tile_seq.numel() == 0 and _seqs(plan.fresh_tile_seq) == {0, 1, 2}


@pytest.mark.parametrize("name", FEATURES)
def test_fresh_prefill_with_every_feature(name):
    """Each feature's scenario with a fresh 37-token prompt in front."""
    sc = SCENARIO_BY_NAME[name]
    sc = dataclasses.replace(sc, query_lens=(37, *sc.query_lens), context_lens=(0, *sc.context_lens))
    assert 0 in _seqs(check(sc, _cfg(16, 16)).fresh_tile_seq)


def test_fresh_prefill_in_float16():
    case = make_case(MIXED, dtype=torch.float16, seed=5)
    poison_unowned_slots(case)
    cfg = _cfg(32, 16)
    backend = TritonBackend(MIXED.problem("float16"), prefill_config=cfg)
    assert backend.fresh_descriptor_reasons(cfg, case.key, case.value) == []
    out, lse = run_backend(functools.partial(TritonBackend, prefill_config=cfg), case, dtype="float16")
    assert_matches(out, lse, *oracle(case), torch.float16)


def test_fp8_cache_keeps_reading_the_quantized_pages():
    scenario = dataclasses.replace(MIXED, spec=MIXED.spec | dict(kv_cache_dtype=KVCacheDtype.FP8_E4M3))
    cfg = _cfg(16, 32)
    backend = TritonBackend(scenario.problem(), prefill_config=cfg)
    assert any("fp8_e4m3 cache" in r for r in backend.fresh_kv_reasons(cfg))
    case = make_case(scenario, seed=6)
    out, lse = run_backend(functools.partial(TritonBackend, prefill_config=cfg), case)
    assert backend.plan(case.metadata).fresh_tile_seq is None
    assert_matches(out, lse, *oracle(case), torch.float32)  # the oracle sees the FP8-rounded keys


def test_dcp_shards_keep_reading_their_pages():
    """Under DCP a rank's cache holds every dcp-th key while forward gets all of them: reading
    those would count keys twice. The merge of both ranks must still equal full attention."""
    cfg = _cfg(16, 32)
    assert any("DCP" in r for r in TritonBackend(MIXED.problem(dcp_size=2), prefill_config=cfg).fresh_kv_reasons(cfg))
    case = make_case(MIXED, seed=7)
    gen = torch.Generator().manual_seed(2)
    parts = [shard_run(case, 2, r, gen, TritonBackend, backend_kwargs={"prefill_config": cfg}) for r in range(2)]
    assert_matches(*merge_shards(parts), *oracle(case), torch.float32)


def test_reasons_say_why_not_and_forward_without_kv_falls_back_to_pages():
    cfg = _cfg(16, 32)
    backend = TritonBackend(MIXED.problem(), prefill_config=cfg)
    assert backend.fresh_kv_reasons(cfg) == []
    assert "fresh_kv=False" in backend.fresh_kv_reasons(dataclasses.replace(cfg, fresh_kv=False))[0]
    cross = SCENARIO_BY_NAME["cross"]
    assert any("cross attention" in r for r in TritonBackend(cross.problem(), prefill_config=cfg).fresh_kv_reasons(cfg))
    encoder_only = SCENARIO_BY_NAME["encoder_only"]
    assert "no KV cache" in TritonBackend(encoder_only.problem(), prefill_config=cfg).fresh_kv_reasons(cfg)[0]

    case = make_case(MIXED, seed=8)
    n = case.query.shape[0]
    assert backend.fresh_input_reasons(case.key, case.value, case.kv_cache, n) == []
    assert "no key/value" in backend.fresh_input_reasons(None, None, case.kv_cache, n)[0]
    assert any("the cache holds other values" in r
               for r in backend.fresh_input_reasons(case.key.half(), case.value, case.kv_cache, n))  # fmt: skip
    # No key/value given: the fresh tiles read the pages (write_kv stored the same keys there).
    plan = backend.plan(case.metadata)
    backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping, plan=plan)
    out, lse = backend.forward(case.query, None, None, case.kv_cache, plan, layer=case.layer, return_lse=True)
    assert_matches(out, lse, *oracle(case), torch.float32)



def test_forward_without_kv_reads_fresh_sequences_as_ordinary_paged_tiles(monkeypatch):
    """With no usable key/value, the fresh sequences read the pages through the step's paged
    config and tiles (plan.prefill), not the fresh config: its 64-key tiles with descriptors
    stack four page loads at pages of 16 (about 7x slower than the gather tiles on an H100).
    Here the fresh config is the CUDA shape of it (CPU has none by default); the regular one
    the CPU's gather tiles."""
    backend = TritonBackend(MIXED.problem(needs_lse=True))
    backend.default_fresh_cfg = _cfg(32, 64)
    case = make_case(MIXED, seed=9)
    plan = backend.plan(case.metadata)
    assert plan.fresh_prefill == _cfg(32, 64) and _seqs(plan.fresh_tile_seq) == {0, 2}
    assert backend.prefill_descriptor_reasons(plan.fresh_prefill, case.kv_cache) == []  # would stack 4 pages
    assert backend.prefill_descriptor_reasons(plan.prefill, case.kv_cache)  # the gather tiles
    backend.write_kv(case.key, case.value, case.kv_cache, case.metadata.slot_mapping, plan=plan)
    launched = []
    prefill = TritonBackend._prefill

    def recording_prefill(self, plan_, cfg, tiles, *args, **kwargs):
        launched.append((cfg, tiles[0].tolist()))
        return prefill(self, plan_, cfg, tiles, *args, **kwargs)

    monkeypatch.setattr(TritonBackend, "_prefill", recording_prefill)
    out, lse = backend.forward(case.query, None, None, case.kv_cache, plan, layer=case.layer, return_lse=True)
    assert_matches(out, lse, *oracle(case), torch.float32)
    assert {cfg for cfg, _ in launched} == {plan.prefill}
    block_m = plan.prefill.block_m  # every prefill sequence in tiles of the paged config, once
    tiles = sorted(s for _, seqs in launched for s in seqs)
    assert tiles == sorted(s for s, q in enumerate(MIXED.query_lens[:3]) for _ in range(0, q, block_m))

def test_row_descriptor_reasons():
    packed = torch.zeros(10, 2, 32)
    assert row_descriptor_reasons(packed, 32, 32, None) == []
    assert any("head_size=24" in r for r in row_descriptor_reasons(torch.zeros(10, 2, 24), 24, 32, None))
    # v as a view of a fused qkv projection: rows are strided, heads still packed: fine.
    qkv = torch.zeros(10, (4 + 2 + 2) * 32)
    assert row_descriptor_reasons(qkv[:, 6 * 32:].view(10, 2, 32), 32, 32, None) == []
    assert any("packed row" in r for r in row_descriptor_reasons(torch.zeros(10, 32, 2).transpose(1, 2), 32, 32, None))
    assert any("16 bytes" in r for r in row_descriptor_reasons(torch.zeros(10, 1, 4, dtype=torch.half), 4, 16, None))


def test_cuda_defaults_leave_fresh_kv_off_until_measured():
    from meshserve.attention.kernels import config

    for page in (16, 64):
        cfg = config.default_prefill_config(128, "bfloat16", "cuda", False, page=page, compute_capability=(9, 0))
        assert not cfg.fresh_kv
    long = config.long_prefill_config(128, "bfloat16", "cuda", False, (9, 0), page=16)
    assert not long.fresh_kv


def test_tiny_llama_generates_the_same_greedy_tokens_with_fresh_kv(tmp_path, monkeypatch):
    """End to end (TRITON under the interpreter): prompts sharing a prefix (prefix-cache hits) in
    chunks of at most 24 tokens (later chunks) beside fresh prompts and decode rows; forcing the
    fresh path on must not change a token, and it must have run."""
    from meshserve import LLM, SamplingParams
    from tests.tiny_models import prompts, write_checkpoint

    write_checkpoint(tmp_path / "llama", "llama", seed=3)
    shared = prompts(1, seed=2, min_len=20, max_len=20)[0]
    batch = [shared + p for p in prompts(2, seed=4, min_len=2, max_len=12)] + prompts(1, seed=5, min_len=9, max_len=9)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def generate(fresh: bool):
        llm = LLM(tmp_path / "llama", attention_backend="TRITON", max_model_len=64, num_kv_blocks=16,
                  max_num_batched_tokens=24, progress=False)  # fmt: skip
        for backend in llm.core.executor.worker.runner.backends:
            backend.prefill_cfg = dataclasses.replace(backend.prefill_cfg, kv_desc=True, fresh_kv=fresh)
        return [o.token_ids for o in llm.generate(batch, params)], llm.core.scheduler.stats.num_prefix_hit_tokens

    calls = []
    fresh_prefill = TritonBackend._fresh_prefill
    monkeypatch.setattr(TritonBackend, "_fresh_prefill", lambda self, *a: calls.append(1) or fresh_prefill(self, *a))
    want, _ = generate(False)
    assert not calls
    got, prefix_hits = generate(True)
    assert got == want
    assert calls and prefix_hits > 0
