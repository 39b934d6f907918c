"""FLASHINFER's ragged prefill (ragged_prefill=True) on CPU: which steps plan FlashInfer's ragged
wrapper, with what, and what forward hands it; the fake `flashinfer` of test_flashinfer_plan.py,
plus a ragged wrapper with FlashInfer 0.5.3's signatures (0.7.4 takes the same arguments; the
numbers are checked on the GPU by tests/gpu/test_flashinfer_ragged_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.backends.flashinfer import FlashInferBackend
from meshserve.attention.spec import KVCacheDtype
from meshserve.errors import ConfigError
from tests.unit.attention.test_flashinfer_plan import PAGE, FakeWrapper, backend, batch, install_fake_flashinfer, ints


class FakeRagged(FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", *, backend="auto") -> None:
        super().__init__("ragged", float_workspace_buffer, kv_layout, backend=backend)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, non_blocking=True):  # fmt: skip
        self.plans.append(dict(locals(), self=None))

    def run(self, q, k, v, *, out=None, lse=None, return_lse=False):
        self.runs.append(dict(q=q.clone(), k=k, v=v, rows=q.shape[0], return_lse=return_lse))
        out.copy_(q[..., : out.shape[-1]])
        if lse is not None:
            lse.fill_(3.0)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return install_fake_flashinfer(monkeypatch, BatchPrefillWithRaggedKVCacheWrapper=FakeRagged)


def ragged(**kw) -> FlashInferBackend:
    be = backend(**kw)
    return FlashInferBackend(be.problem, ragged_prefill=True)


def _step_tensors(md):
    q = torch.randn(md.num_tokens, 8, 64).to(torch.bfloat16)
    k, v = (torch.randn(md.num_tokens, 2, 64).to(torch.bfloat16) for _ in range(2))
    return q, k, v, KVCache(torch.zeros(200, 2, PAGE, 2, 64, dtype=torch.bfloat16))


def test_all_fresh_step_runs_the_ragged_wrapper_over_the_steps_kv(fake_flashinfer):
    be = ragged(sliding_window=8, logits_soft_cap=30.0)
    md = batch((7, 20, 1, 1), (7, 20, 21, 46))  # two whole prompts, two decodes
    assert be.ragged_prefill_reasons(md) == []
    plan = be.plan(md)
    rag = next(w for w in fake_flashinfer.built if w.kind == "ragged")
    paged = next(w for w in fake_flashinfer.built if w.kind == "prefill")
    decode = next(w for w in fake_flashinfer.built if w.kind == "decode")
    assert plan.ragged and plan.prefill is rag and paged.plans == []
    assert rag.workspace is decode.workspace and rag.kwargs["backend"] == be.prefill_kernel == "fa3"
    (p,) = rag.plans
    assert ints(p["qo_indptr"]) == ints(p["kv_indptr"]) == [0, 7, 27]
    assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim_qk"]) == (8, 2, 64)
    assert p["causal"] is True and p["window_left"] == 7 and p["logits_soft_cap"] == 30.0
    assert p["q_data_type"] == p["kv_data_type"] == torch.bfloat16
    assert len(decode.plans) == 1

    q, k, v, cache = _step_tensors(md)
    out = be.forward(q, k, v[:, :, :], cache, plan)
    (run,), (drun,) = rag.runs, decode.runs
    assert torch.equal(run["q"], q[:27]) and torch.equal(run["k"], k[:27]) and torch.equal(run["v"], v[:27])
    assert drun["rows"] == 2 and drun["paged_kv_cache"] is cache.data
    assert torch.equal(out, q)


def test_a_sequence_with_cached_context_keeps_the_paged_wrapper(fake_flashinfer):
    be = ragged()
    md = batch((7, 12, 1), (7, 32, 21))  # a fresh prompt, a chunk after 20 cached tokens, a decode
    assert any("1 of 2 prefill sequences have cached context" in r for r in be.ragged_prefill_reasons(md))
    plan = be.plan(md)
    assert not plan.ragged and plan.prefill.kind == "prefill" and len(plan.prefill.plans) == 1
    assert not any(w.kind == "ragged" for w in fake_flashinfer.built)  # never built, never planned
    q, k, v, cache = _step_tensors(md)
    be.forward(q, k, v, cache, plan)
    assert plan.prefill.runs[0]["paged_kv_cache"] is cache.data


def test_reasons_refuse_the_default_fp8_caches_and_dcp(fake_flashinfer):
    md = batch((7,), (7,))
    assert "ragged_prefill=False" in backend().ragged_prefill_reasons(md)[0]
    assert not backend().plan(md).ragged
    fp8 = ragged(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    assert any("fp8_e4m3 cache" in r for r in fp8.ragged_prefill_reasons(md))
    assert not fp8.plan(md).ragged
    dcp = FlashInferBackend(dataclasses.replace(backend().problem, dcp_size=2), ragged_prefill=True)
    assert any("DCP" in r for r in dcp.ragged_prefill_reasons())


def test_forward_without_the_steps_kv_names_the_field(fake_flashinfer):
    be = ragged()
    md = batch((7, 5), (7, 5))
    plan = be.plan(md)
    q, k, v, cache = _step_tensors(md)
    with pytest.raises(ConfigError, match="key"):
        be.forward(q, None, None, cache, plan)
    with pytest.raises(ConfigError, match="value"):
        be.forward(q, k, v.float(), cache, plan)


def test_ragged_is_the_default_from_sm90_only(fake_flashinfer):
    """Measured faster on an H100 (docs/performance.md); older GPUs keep the paged wrapper, saying why."""
    md = batch((7,), (7,))
    assert backend(ragged_prefill=None).plan(md).ragged
    sm80 = FlashInferBackend(dataclasses.replace(backend().problem, compute_capability=(8, 0)))
    assert not sm80.plan(md).ragged
    assert "the default below sm_90" in sm80.ragged_prefill_reasons(md)[0]
