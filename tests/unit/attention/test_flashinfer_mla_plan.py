"""FLASHINFER MLA's host side on CPU, eager and CUDA-graph plans, through a fake FlashInfer.

The fake `flashinfer.mla.BatchMLAPagedAttentionWrapper` takes FlashInfer 0.5.3's signatures for
the arguments meshserve passes and behaves as the real one does with them: in graph mode `plan`
copies the index lists into the buffers handed to the constructor (and `run` reads the page ids
from there), otherwise it keeps its own copies. Its `run` is absorbed MLA in float64 over the
pages those lists name, so a wrong list gives wrong attention: the backend's output is checked
against the TORCH MLA reference (expanded per-head K/V) on the same cache.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

from meshserve.attention.mla.backends import flashinfer as fi_mla
from meshserve.attention.mla.backends.flashinfer import FlashInferMLADecodeBackend
from meshserve.attention.mla.backends.torch_ref import TorchMLABackend
from meshserve.attention.mla.cache import write_latent_kv_torch
from meshserve.attention.spec import KVCacheDtype, MLADims
from meshserve.errors import ConfigError
from tests.unit.attention.mla_cases import MLAScenario, make_mla_case
from tests.unit.attention.scenarios import assert_matches

DIMS = MLADims(kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16)
DECODE = MLAScenario("fi_decode", (1, 1, 1), (4, 40, 16), num_heads=4, dims=DIMS, block_size=16, max_model_len=128)


class FakeMLAWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto") -> None:  # fmt: skip
        self.use_cuda_graph, self.backend = use_cuda_graph, backend
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.plans: list[dict] = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):  # fmt: skip
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32, t.dtype
        self.plans.append(dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                               kv_len=kv_len_arr.tolist(), page_size=page_size, causal=causal, sm_scale=sm_scale,
                               num_heads=num_heads, dims=(head_dim_ckv, head_dim_kpe)))  # fmt: skip
        if self.use_cuda_graph:
            _, indptr_buf, indices_buf, len_buf = self.buffers
            indptr_buf.copy_(kv_indptr)
            indices_buf[: len(kv_indices)].copy_(kv_indices)
            len_buf.copy_(kv_len_arr)
            self.indices = indices_buf
        else:
            self.indices = kv_indices.clone()

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None, return_lse_base_on_e=False):  # fmt: skip
        plan = self.plans[-1]
        scale = plan["sm_scale"]
        outs, lses = [], []
        for i in range(q_nope.shape[0]):
            pages = self.indices[plan["kv_indptr"][i] : plan["kv_indptr"][i + 1]].long()
            n = plan["kv_len"][i]
            c = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:n].double()
            k = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:n].double()
            logits = (q_nope[i].double() @ c.T + q_pe[i].double() @ k.T) * scale  # [H, n]
            lse_i = torch.logsumexp(logits, dim=-1)
            outs.append(torch.exp(logits - lse_i[:, None]) @ c)
            lses.append(lse_i if return_lse_base_on_e else lse_i / np.log(2))
        o = torch.stack(outs).to(q_nope.dtype)
        return (o, torch.stack(lses).float()) if return_lse else o


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", loader=None)  # find_spec finds it
    module.built = []

    def build(*args, **kwargs):
        module.built.append(FakeMLAWrapper(*args, **kwargs))
        return module.built[-1]

    module.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=build)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi_mla, "WORKSPACE_BYTES", 4096)  # not 128 MiB of CPU memory per test
    return module


def _case():
    problem = replace(DECODE.problem(), dtype="bfloat16", device="cuda", compute_capability=(9, 0))
    assert FlashInferMLADecodeBackend.validate_configuration(problem) == []
    case = make_mla_case(DECODE, seed=4)
    write_latent_kv_torch(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    ref = TorchMLABackend(DECODE.problem()).forward(case.query, case.cache, case.metadata, case.weights,
                                                    return_lse=True)  # fmt: skip
    return FlashInferMLADecodeBackend(problem), case, ref


def test_eager_plan_pages_each_row_and_matches_the_reference(fake_flashinfer):
    backend, case, (ref_out, ref_lse) = _case()
    plan = backend.plan(case.metadata)
    wrapper = fake_flashinfer.built[-1]
    assert not wrapper.use_cuda_graph and plan.wrapper is wrapper
    assert wrapper.plans[-1]["kv_len"] == list(DECODE.seq_lens) and not wrapper.plans[-1]["causal"]
    out, lse = backend.forward(case.query, case.cache, plan, case.weights, return_lse=True)
    assert_matches(out, lse, ref_out.double(), ref_lse.double(), torch.float32)


def test_graph_plan_fills_fixed_buffers_and_replays_any_step(fake_flashinfer):
    """plan_for_graph: a graph-mode wrapper of its own with buffers sized for the bucket and the
    longest table, planned once over padding rows; prepare_replay re-plans from the step's host
    arrays (a padding row, stale table tails), and the run over those buffers matches the reference."""
    backend, case, (ref_out, ref_lse) = _case()
    b, width = 4, DECODE.max_model_len // DECODE.block_size
    meta = case.metadata
    static = replace(meta, query_start_loc=torch.arange(b + 1, dtype=torch.int32),
                     seq_lens=torch.ones(b, dtype=torch.int32), block_table=torch.zeros(b, width, dtype=torch.int32),
                     slot_mapping=torch.zeros(b, dtype=torch.int64), num_decodes=b, query_lens_host=(1,) * b,
                     seq_lens_host=(DECODE.max_model_len,) * b, max_seq_len=DECODE.max_model_len)  # fmt: skip
    plan = backend.plan_for_graph(static)
    wrapper = plan.wrapper
    assert wrapper.use_cuda_graph and wrapper is not backend._wrapper
    qo, indptr_buf, indices_buf, len_buf = wrapper.buffers
    assert (len(qo), len(indptr_buf), len(indices_buf), len(len_buf)) == (b + 1, b + 1, b * width, b)
    assert wrapper.plans[-1]["kv_len"] == [1] * b  # captured over padding rows: one key each
    addresses = [t.data_ptr() for t in wrapper.buffers]

    rows = meta.block_table.numpy()
    table = np.full((b, width), 99, np.int32)  # 99: a stale entry past every row's pages, never read
    table[:3, : rows.shape[1]] = np.where(rows >= 0, rows, 99)
    for i, n in enumerate(DECODE.seq_lens):
        table[i, -(-n // DECODE.block_size) :] = 99
    table[3] = 0  # the padding row: the null block
    seq_lens = np.array([*DECODE.seq_lens, 1], np.int32)
    backend.prepare_replay(plan, seq_lens, table)
    assert [t.data_ptr() for t in wrapper.buffers] == addresses  # the graph's buffers, refilled in place
    assert len_buf.tolist() == seq_lens.tolist()
    counts = [-(-n // DECODE.block_size) for n in seq_lens]
    assert indptr_buf.tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()
    assert 99 not in indices_buf[: sum(counts)].tolist() and indices_buf[sum(counts) - 1] == 0  # padding: block 0

    query = torch.cat([case.query, torch.randn(1, *case.query.shape[1:])])  # the padding row's query
    out, lse = backend.forward(query, case.cache, plan, case.weights, return_lse=True)
    assert_matches(out[:3], lse[:3], ref_out.double(), ref_lse.double(), torch.float32)
    with pytest.raises(ConfigError, match="block_tables"):  # a row shorter than its length
        backend.prepare_replay(plan, seq_lens, table[:, :1])
    with pytest.raises(ConfigError, match="dcp_size"):
        backend.plan_for_graph(replace(static, dcp_size=2))


class FakeMLAWrapper07(FakeMLAWrapper):
    """FlashInfer 0.7's form: keyword-only `plan(metadata=MLAPlanMetadata.csr(...), ...)` that declares
    the run contract, and `run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), ...)` that must keep it;
    an FP8 plan needs scale_mode="kv-per-tensor" and its run the per-tensor scales (applied here)."""

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout, kv_cache_layout, lse_mode, scale_mode="default"):  # fmt: skip
        fp8 = kv_data_type in (torch.float8_e4m3fn, torch.float8_e5m2)
        assert (query_layout, kv_cache_layout, lse_mode) == ("split", "split", "basee")
        assert scale_mode == ("kv-per-tensor" if fp8 else "default")
        self.contract = dict(fp8=fp8)
        super().plan(metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr, num_heads,
                     head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)  # fmt: skip

    def run(self, *, query, kv_cache, return_lse=False, return_lse_base_on_e=False, ckv_scale=None, kpe_scale=None):
        assert return_lse and return_lse_base_on_e  # the plan declared a natural-log LSE
        assert (ckv_scale is not None) == self.contract["fp8"] == (kpe_scale is not None)
        (q_nope, q_pe), (ckv, kpe) = query, kv_cache
        if self.contract["fp8"]:
            ckv, kpe = ckv.double() * ckv_scale, kpe.double() * kpe_scale
        return super().run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3])
def test_flashinfer_07_api_with_bf16_and_fp8_latent_caches(fake_flashinfer, monkeypatch, kv_dtype):
    """With FlashInfer 0.7 installed the backend plans from MLAPlanMetadata and runs with structural
    inputs; an FP8 cache's scale is folded into the query and the output, FlashInfer's scales stay 1."""
    monkeypatch.setattr(fi_mla, "flashinfer_version", lambda: (0, 7))
    csr = lambda qo, kv, idx, lens: types.SimpleNamespace(qo_indptr=qo, kv_indptr=kv, kv_indices=idx,  # noqa: E731
                                                           kv_len_arr=lens)
    fake_flashinfer.mla.MLAPlanMetadata = types.SimpleNamespace(csr=csr)

    def build(*args, **kwargs):
        fake_flashinfer.built.append(FakeMLAWrapper07(*args, **kwargs))
        return fake_flashinfer.built[-1]

    fake_flashinfer.mla.BatchMLAPagedAttentionWrapper = build
    sc = replace(DECODE, kv_cache_dtype=kv_dtype)
    problem = replace(sc.problem(), dtype="bfloat16", device="cuda", compute_capability=(9, 0))
    assert FlashInferMLADecodeBackend.validate_configuration(problem) == []
    case = make_mla_case(sc, seed=4)
    write_latent_kv_torch(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    ref_out, ref_lse = TorchMLABackend(sc.problem()).forward(case.query, case.cache, case.metadata, case.weights,
                                                             return_lse=True)  # fmt: skip
    backend = FlashInferMLADecodeBackend(problem)
    assert backend.kernel == "fa3" and fake_flashinfer.built == []
    plan = backend.plan(case.metadata)
    assert isinstance(plan.wrapper, FakeMLAWrapper07) and plan.wrapper.backend == "fa3"
    out, lse = backend.forward(case.query, case.cache, plan, case.weights, return_lse=True)
    assert_matches(out, lse, ref_out.double(), ref_lse.double(), torch.float32)
