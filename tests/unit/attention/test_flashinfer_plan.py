"""FLASHINFER's host side on CPU: what `plan` and `forward` hand to FlashInfer's wrappers.

A fake `flashinfer` module (in sys.modules, with a module spec so the backend's
required-package check finds it) records every wrapper it builds and every plan / run call. Its
signatures are FlashInfer 0.5.3's for the arguments meshserve passes, so a renamed keyword fails
here too. The problem says device "cuda" (the backend's validation is the real one); the step's
tensors live on the CPU, where the backend plans and the fake runs.

Checked: CSR page lists (indptr, indices, last_page_len) against a brute-force count of pages,
which rows go to the prefill and which to the decode wrapper, causal only for decoders,
window_left = W - 1, the soft-cap, the dtypes (FP8 caches: FA2 prefill), tensor-core decode,
one wrapper pair per KV group, cross attention reading the encoder tables, and forward's
conventions (LSE base 2 -> natural log, FP8 scales folded into q and the output).
"""

from __future__ import annotations

import importlib.machinery
import math
import random
import sys
import types

import numpy as np
import pytest
import torch

from meshserve.attention.backend import AttentionProblem, KVCache
from meshserve.attention.backends import flashinfer as fi_backend
from meshserve.attention.backends.flashinfer import FlashInferBackend, FlashInferPlan
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype
from meshserve.errors import ConfigError

PAGE = 16
LSE2 = 3.0  # what the fake returns as the base-2 LSE


class FakeWrapper:
    """Records its construction and every plan / run; run writes q (first v_size features) to out."""

    def __init__(self, kind: str, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs) -> None:
        self.kind, self.workspace, self.kv_layout, self.kwargs = kind, float_workspace_buffer, kv_layout, kwargs
        self.plans: list[dict] = []
        self.runs: list[dict] = []

    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse=False):
        self.runs.append(dict(q=q.clone(), paged_kv_cache=paged_kv_cache, rows=q.shape[0], return_lse=return_lse))
        out.copy_(q[..., : out.shape[-1]])
        if lse is not None:
            lse.fill_(LSE2)


class FakePrefill(FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", *, backend="auto") -> None:
        super().__init__("prefill", float_workspace_buffer, kv_layout, backend=backend)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", sm_scale=None,
             window_left=-1, logits_soft_cap=None, q_data_type="float16", kv_data_type=None):
        self.plans.append(dict(locals(), self=None))


class FakeDecode(FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", *, use_tensor_cores=False, use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto") -> None:
        graph = {"use_cuda_graph": True} if use_cuda_graph else {}
        super().__init__("decode", float_workspace_buffer, kv_layout, use_tensor_cores=use_tensor_cores,
                         backend=backend, **graph)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, sm_scale=None, non_blocking=True):
        self.plans.append(dict(locals(), self=None))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return install_fake_flashinfer(monkeypatch)


def install_fake_flashinfer(monkeypatch, **wrappers) -> types.ModuleType:
    """The fake module in sys.modules; wrappers: more wrapper classes by FlashInfer's name."""
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", loader=None)  # find_spec finds it
    module.built = []

    def factory(cls):
        def build(*args, **kwargs):
            wrapper = cls(*args, **kwargs)
            module.built.append(wrapper)
            return wrapper
        return build

    module.BatchPrefillWithPagedKVCacheWrapper = factory(FakePrefill)
    module.BatchDecodeWithPagedKVCacheWrapper = factory(FakeDecode)
    for name, cls in wrappers.items():
        setattr(module, name, factory(cls))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fi_backend, "WORKSPACE_BYTES", 4096)  # not 128 MiB of CPU memory per test
    return module


def backend(dcp_size: int = 1, ragged_prefill: bool | None = False, **spec) -> FlashInferBackend:
    """The paged wrappers' backend (ragged_prefill off: test_flashinfer_ragged_plan.py has the ragged one)."""
    spec = dict(num_heads=8, num_kv_heads=2, head_size=64) | spec
    problem = AttentionProblem(spec=AttentionSpec(**spec), dtype="bfloat16", block_size=PAGE, max_model_len=1024,
                               device="cuda", compute_capability=(9, 0), dcp_size=dcp_size)
    assert FlashInferBackend.validate_configuration(problem) == []
    return FlashInferBackend(problem, ragged_prefill=ragged_prefill)


def batch(query_lens, seq_lens, *, kv_group=0, seed=0, **kwargs) -> AttentionMetadata:
    """Block tables of distinct, shuffled ids (a paging bug reads the wrong page)."""
    ids = list(range(1, 200))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for s in seq_lens:
        n = -(-s // PAGE)
        tables.append(ids[at : at + n])
        at += n
    return AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                   block_size=PAGE, kv_group=kv_group, **kwargs)


def expected_pages(table: torch.Tensor, kv_lens) -> tuple[list[int], list[int], list[int]]:
    """Brute force: the pages a row touches are those holding positions 0..n-1."""
    indptr, indices, last = [0], [], []
    for row, n in zip(table.tolist(), kv_lens):
        pages = sorted({pos // PAGE for pos in range(n)})
        indices += [row[p] for p in pages]
        indptr.append(len(indices))
        last.append(n - pages[-1] * PAGE)
    return indptr, indices, last


def ints(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32, t.dtype
    return t.tolist()


def test_mixed_batch_plans_prefill_rows_on_the_prefill_wrapper_and_decode_rows_on_decode(fake_flashinfer):
    be = backend()
    # two prefills (a whole prompt; a chunk after 20 cached tokens, ending on a page boundary),
    # then two decodes (5 and 14 tokens on the last page)
    md = batch((7, 12, 1, 1), (7, 32, 21, 46))
    plan = be.plan(md)
    prefill, decode = fake_flashinfer.built
    assert (prefill.kind, decode.kind) == ("prefill", "decode")
    assert prefill.workspace is decode.workspace and prefill.kv_layout == decode.kv_layout == "NHD"
    assert isinstance(plan, FlashInferPlan) and plan.has_prefill and plan.has_decode
    assert plan.num_prefill_tokens == 19 and plan.prefill is prefill and plan.decode is decode

    (p,) = prefill.plans
    assert ints(p["qo_indptr"]) == [0, 7, 19]
    indptr, indices, last = expected_pages(md.block_table[:2], (7, 32))
    assert ints(p["paged_kv_indptr"]) == indptr == [0, 1, 3]
    assert ints(p["paged_kv_indices"]) == indices
    assert ints(p["paged_kv_last_page_len"]) == last == [7, 16]  # a full last page is 16, not 0
    assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim_qk"], p["page_size"]) == (8, 2, 64, PAGE)
    assert p["causal"] is True and p["pos_encoding_mode"] == "NONE"

    (d,) = decode.plans
    indptr, indices, last = expected_pages(md.block_table[2:], (21, 46))
    assert ints(d["indptr"]) == indptr == [0, 2, 5]
    assert ints(d["indices"]) == indices
    assert ints(d["last_page_len"]) == last == [5, 14]
    assert (d["num_qo_heads"], d["num_kv_heads"], d["head_dim"], d["page_size"]) == (8, 2, 64, PAGE)
    for call in (p, d):
        assert call["window_left"] == -1 and call["logits_soft_cap"] == 0.0
        assert call["sm_scale"] == pytest.approx(1 / 8)
        assert call["q_data_type"] == call["kv_data_type"] == torch.bfloat16

    # forward: rows [0, 19) through prefill.run, [19, 21) through decode.run, once each
    q = torch.randn(21, 8, 64).to(torch.bfloat16)
    cache = KVCache(torch.zeros(200, 2, PAGE, 2, 64, dtype=torch.bfloat16))
    out, lse = be.forward(q, None, None, cache, plan, return_lse=True)
    (run_p,), (run_d,) = prefill.runs, decode.runs
    assert torch.equal(run_p["q"], q[:19]) and torch.equal(run_d["q"], q[19:])
    assert run_p["paged_kv_cache"] is cache.data and run_p["return_lse"] is True
    assert torch.equal(out, q)
    assert torch.allclose(lse, torch.full((21, 8), LSE2 * math.log(2.0)))  # base 2 -> natural log


@pytest.mark.parametrize("kind", ["decode_only", "prefill_only"])
def test_only_the_wrapper_with_rows_is_planned_and_run(fake_flashinfer, kind):
    be = backend()
    md = batch((1, 1, 1), (3, 17, 64)) if kind == "decode_only" else batch((5, 40), (5, 40))
    plan = be.plan(md)
    prefill, decode = fake_flashinfer.built
    planned, idle = (decode, prefill) if kind == "decode_only" else (prefill, decode)
    assert len(planned.plans) == 1 and idle.plans == []
    assert (plan.has_prefill, plan.has_decode) == (kind == "prefill_only", kind == "decode_only")
    q = torch.randn(md.num_tokens, 8, 64).to(torch.bfloat16)
    out = be.forward(q, None, None, KVCache(torch.zeros(200, 2, PAGE, 2, 64, dtype=torch.bfloat16)), plan)
    assert [r["rows"] for r in planned.runs] == [md.num_tokens] and idle.runs == []
    assert torch.equal(out, q)


def test_window_soft_cap_and_non_causal_types_reach_both_wrappers(fake_flashinfer):
    be = backend(sliding_window=8, logits_soft_cap=30.0, scale=0.05)
    be.plan(batch((9, 1), (9, 40)))
    prefill, decode = fake_flashinfer.built
    for call in prefill.plans + decode.plans:
        assert call["window_left"] == 7  # a query sees keys with qp - kp < 8
        assert call["logits_soft_cap"] == 30.0 and call["sm_scale"] == 0.05
    assert prefill.plans[0]["causal"] is True

    fake_flashinfer.built.clear()
    backend(attn_type=AttentionType.ENCODER).plan(batch((13, 7), (13, 7)))
    assert fake_flashinfer.built[0].plans[0]["causal"] is False


@pytest.mark.parametrize(("kv_dtype", "torch_dtype", "prefill_backend"), [
    (KVCacheDtype.AUTO, torch.bfloat16, "fa3"),  # the problem is on sm90
    (KVCacheDtype.FP8_E4M3, torch.float8_e4m3fn, "fa2"),  # FA3's FP8 kernel wants an FP8 query
    (KVCacheDtype.FP8_E5M2, torch.float8_e5m2, "fa2"),
])
def test_kv_cache_dtype_picks_the_kv_data_type_and_the_prefill_kernel(fake_flashinfer, kv_dtype, torch_dtype,
                                                                      prefill_backend):
    be = backend(kv_cache_dtype=kv_dtype)
    be.plan(batch((6, 1), (6, 30)))
    prefill, decode = fake_flashinfer.built
    assert prefill.kwargs == {"backend": prefill_backend}
    for call in prefill.plans + decode.plans:
        assert call["q_data_type"] == torch.bfloat16 and call["kv_data_type"] == torch_dtype


def test_fp8_scales_fold_into_the_query_and_the_output(fake_flashinfer):
    be = backend(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    plan = be.plan(batch((3, 1), (3, 20)))
    prefill, decode = fake_flashinfer.built
    cache = KVCache(torch.zeros(200, 2, PAGE, 2, 64, dtype=torch.float8_e4m3fn),
                    k_scale=torch.tensor(0.5), v_scale=torch.tensor(4.0))
    q = torch.randn(4, 8, 64).to(torch.bfloat16)
    out = be.forward(q, None, None, cache, plan)
    scaled_q = (q.float() * 0.5).to(torch.bfloat16)  # FlashInfer sees q * k_scale
    assert torch.equal(prefill.runs[0]["q"], scaled_q[:3]) and torch.equal(decode.runs[0]["q"], scaled_q[3:])
    assert torch.equal(out, (scaled_q.float() * 4.0).to(torch.bfloat16))  # and the output times v_scale


@pytest.mark.parametrize(("num_heads", "tensor_cores"), [(8, True), (4, False)])
def test_tensor_core_decode_for_gqa_groups_of_four_or_more(fake_flashinfer, num_heads, tensor_cores):
    backend(num_heads=num_heads).plan(batch((1,), (9,)))
    assert fake_flashinfer.built[1].kwargs == {"use_tensor_cores": tensor_cores, "backend": "fa2"}


def test_each_kv_group_keeps_its_own_wrappers_over_one_workspace(fake_flashinfer):
    be = backend()
    plan0 = be.plan(batch((4, 1), (4, 20), kv_group=0))
    plan1 = be.plan(batch((2, 1), (2, 33), kv_group=1, seed=1))
    again = be.plan(batch((1,), (21,), kv_group=0))
    assert len(fake_flashinfer.built) == 4  # two pairs, no new wrapper for group 0's next step
    assert plan0.prefill is again.prefill and plan0.decode is again.decode
    assert plan1.prefill is not plan0.prefill and plan1.decode is not plan0.decode
    assert len({id(w.workspace) for w in fake_flashinfer.built}) == 1
    assert len(plan0.decode.plans) == 2 and len(plan1.decode.plans) == 1


def test_cross_attention_pages_the_encoder_cache(fake_flashinfer):
    be = backend(attn_type=AttentionType.CROSS)
    enc_lens, enc_tables = (17, 40), [[9, 4], [30, 31, 7]]
    md = batch((5, 3), (5, 3), encoder_seq_lens=enc_lens, encoder_block_tables=enc_tables)
    be.plan(md)
    (p,) = fake_flashinfer.built[0].plans
    assert ints(p["paged_kv_indptr"]) == [0, 2, 5]
    assert ints(p["paged_kv_indices"]) == [9, 4, 30, 31, 7]
    assert ints(p["paged_kv_last_page_len"]) == [1, 8]
    assert p["causal"] is False


# ---------------------------------------------------------------------------- DCP-sharded caches
def brute_mask(query_lens, seq_lens, dcp, rank, window=None) -> list[bool]:
    """Key slot l of this rank (global position l * dcp + rank) is visible to the query at qp."""
    out = []
    for q, s in zip(query_lens, seq_lens):
        n = max((s - rank + dcp - 1) // dcp, 1)
        for qp in range(s - q, s):
            for slot in range(n):
                kp = slot * dcp + rank
                out.append(kp < s and kp <= qp and (window is None or qp - kp < window))
    return out


@pytest.mark.parametrize(("dcp", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_dcp_pages_local_tokens_and_masks_prefill_rows_by_global_position(fake_flashinfer, dcp, rank):
    be = backend(dcp_size=dcp)
    q_lens, s_lens = (7, 12, 1, 1), (7, 40, 21, 46)  # a prompt, a chunk after 28 cached, two decodes
    md = batch(q_lens, s_lens, dcp_size=dcp, dcp_rank=rank)
    plan = be.plan(md)
    prefill, decode = fake_flashinfer.built
    local = [max((s - rank + dcp - 1) // dcp, 1) for s in s_lens]
    (p,) = prefill.plans
    assert p["causal"] is False and p["window_left"] == -1  # FlashInfer's masks compare local indices
    assert p["custom_mask"].tolist() == brute_mask(q_lens[:2], s_lens[:2], dcp, rank)
    indptr, indices, last = expected_pages(md.block_table[:2], local[:2])
    assert (ints(p["paged_kv_indptr"]), ints(p["paged_kv_indices"]), ints(p["paged_kv_last_page_len"])) == (
        indptr, indices, last)
    (d,) = decode.plans
    indptr, indices, last = expected_pages(md.block_table[2:], local[2:])
    assert (ints(d["indptr"]), ints(d["indices"]), ints(d["last_page_len"])) == (indptr, indices, last)
    assert d["window_left"] == -1  # the decode query is the newest token: every local key is older
    assert plan.num_prefill_tokens == 19 and plan.has_prefill and plan.has_decode


def test_dcp_with_a_window_masks_decode_rows_on_the_prefill_wrapper(fake_flashinfer):
    be = backend(dcp_size=2, sliding_window=8)
    q_lens, s_lens = (9, 1, 1), (30, 21, 46)
    plan = be.plan(batch(q_lens, s_lens, dcp_size=2, dcp_rank=1))
    prefill, decode = fake_flashinfer.built
    (p,) = prefill.plans
    assert decode.plans == [] and not plan.has_decode and plan.num_prefill_tokens == 11
    assert ints(p["qo_indptr"]) == [0, 9, 10, 11]
    assert p["custom_mask"].tolist() == brute_mask(q_lens, s_lens, 2, 1, window=8)
    assert p["window_left"] == -1 and p["causal"] is False


def test_dcp_rows_that_see_no_key_of_the_shard_come_out_zero_with_lse_minus_inf(fake_flashinfer):
    be = backend(dcp_size=4)
    # rank 3 holds position 3 of the prompt only; decodes at seq_len 3 (nothing here) and 9 (3, 7)
    md = batch((5, 1, 1), (5, 3, 9), dcp_size=4, dcp_rank=3)
    plan = be.plan(md)
    q = torch.randn(7, 8, 64).to(torch.bfloat16)
    out, lse = be.forward(q, None, None, KVCache(torch.zeros(200, 2, PAGE, 2, 64, dtype=torch.bfloat16)), plan,
                          return_lse=True)
    empty = [0, 1, 2, 5]  # prompt queries at 0..2 see no key of rank 3; the seq_len-3 decode has none
    assert sorted(plan.empty_rows.tolist()) == empty
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and torch.all(lse[empty] == float("-inf"))
    kept = [3, 4, 6]
    assert torch.equal(out[kept], q[kept]) and torch.allclose(lse[kept], torch.full((3, 8), LSE2 * math.log(2.0)))
    (d,) = fake_flashinfer.built[1].plans
    assert ints(d["last_page_len"]) == [1, 2]  # an empty request pages one slot (zeroed above)


def _page_lists_per_row(rows, kv_lens, page):
    """The page lists' definition, row by row (the loop the array version replaced)."""
    counts = [-(-n // page) for n in kv_lens]
    indptr, indices = [0], []
    for row, c in zip(rows, counts):
        indptr.append(indptr[-1] + c)
        indices.extend(row[:c])
    return indptr, indices, [n - (c - 1) * page for n, c in zip(kv_lens, counts)]


@pytest.mark.parametrize("seed", range(6))
def test_page_lists_equal_the_per_row_definition(seed):
    rng = random.Random(seed)
    page = rng.choice([16, 32, 64])
    n = rng.randrange(1, 40)
    kv_lens = [rng.randrange(1, 12 * page) for _ in range(n)]
    rows = [[rng.randrange(1, 5000) for _ in range(-(-k // page) + rng.randrange(0, 3))] for k in kv_lens]
    want = _page_lists_per_row(rows, kv_lens, page)
    width = max(map(len, rows))
    padded = np.array([r + [rng.randrange(1, 5000)] * (width - len(r)) for r in rows], np.int32)  # stale tails
    for table in (rows, padded):
        got = fi_backend._page_lists(table, kv_lens, page)
        assert all(t.dtype == torch.int32 for t in got)
        assert [t.tolist() for t in got] == [list(w) for w in want]
    with pytest.raises(ConfigError, match="block_tables"):  # a row shorter than its KV length
        fi_backend._page_lists(padded[:, :1], [2 * page] * n, page)


def test_graph_replay_plans_page_lists_from_the_static_rows(fake_flashinfer):
    """plan_for_graph builds a graph-mode decode wrapper; prepare_replay re-plans it from the
    step's host arrays (padded [b, W] rows with stale tails, as DecodeGraphs hands them over)."""
    be = backend()
    md = batch((1, 1, 1), (21, 46, 5))
    plan = be.plan_for_graph(md)
    wrapper = fake_flashinfer.built[-1]
    assert wrapper.kwargs.get("use_cuda_graph") and wrapper.plans  # planned once (padding rows) to capture with
    seq_lens = np.array([33, 2, 17], np.int32)
    table = np.array([[9, 8, 7, 6], [5, 99, 99, 99], [4, 3, 99, 99]], np.int32)  # 99: stale, never paged
    be.prepare_replay(plan, seq_lens, table)
    p = wrapper.plans[-1]
    want = expected_pages(torch.from_numpy(table), seq_lens.tolist())
    assert (ints(p["indptr"]), ints(p["indices"]), ints(p["last_page_len"])) == want
    assert 99 not in ints(p["indices"])


@pytest.mark.parametrize(
    ("cc", "spec", "dcp", "want_prefill"),
    [
        ((9, 0), {}, 1, "fa3"),  # Hopper, bf16 K/V: FA3 prefill
        ((9, 0), {}, 2, "fa2"),  # DCP prefill masks by global position: a custom mask, which FA3 does not take
        ((8, 0), {}, 1, "fa2"),
        ((10, 0), {}, 1, "fa2"),
    ],
)
def test_wrappers_are_built_with_the_named_flashinfer_kernels(fake_flashinfer, cc, spec, dcp, want_prefill):
    spec = dict(num_heads=8, num_kv_heads=2, head_size=64) | spec
    problem = AttentionProblem(spec=AttentionSpec(**spec), dtype="bfloat16", block_size=PAGE, max_model_len=1024,
                               device="cuda", compute_capability=cc, dcp_size=dcp)  # fmt: skip
    fi = FlashInferBackend(problem, ragged_prefill=False)
    fi.plan(batch((5, 1), (5, 40), dcp_size=dcp, dcp_rank=0) if dcp > 1 else batch((5, 1), (5, 40)))
    prefill, decode = fake_flashinfer.built
    assert prefill.kwargs["backend"] == want_prefill
    assert decode.kwargs["backend"] == "fa2"
