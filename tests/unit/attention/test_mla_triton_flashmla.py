"""The FlashMLA-structured TRITON MLA decode kernel (kernels/mla_decode_fm.py) on the CPU interpreter,
against the float64 per-head oracle: one program or two splitting the output columns, pages of
64, 16 and 4 (tiles inside a page and tiles across pages), ragged lengths, forced KV splits with
their LSE merge, and a CUDA-graph plan serving shorter rows. The default kernel's tests are in
test_mla_triton.py; this kernel is selected only by its config, never by default.
"""

import math
from dataclasses import replace

import pytest
import torch

from meshserve.attention.mla.backends.triton_common import (
    MLADecodeConfig,
    MLADecodeKernel,
    decode_config,
    flashmla_decode_config,
    measured_decode_config,
)
from meshserve.attention.mla.backends.triton_decode import TritonMLADecodeBackend
from meshserve.attention.mla.cache import write_latent_kv_torch
from meshserve.errors import ConfigError
from tests.unit.attention.mla_cases import MLA_BY_NAME, MLAScenario, make_mla_case, mla_oracle
from tests.unit.attention.scenarios import assert_matches

PAGE64 = MLAScenario("page64_decode", (1, 1, 1), (130, 63, 80), block_size=64)
SCENARIOS = {**{n: MLA_BY_NAME[n] for n in ("small_decode", "long_decode", "many_heads_decode",
                                             "small_page_decode", "odd_dims", "fp8_e4m3")},
             "page64_decode": PAGE64}  # fmt: skip


def decode_case(sc, seed):
    """The scenario with every token written (decode-only scenarios: the batch is all decodes)."""
    case = make_mla_case(sc, seed=seed)
    assert case.metadata.num_prefills == 0 or sc.name in ("odd_dims", "fp8_e4m3")
    write_latent_kv_torch(case.latent, case.k_pe, case.cache, case.metadata.slot_mapping)
    return case


def decode_only(case):
    """(metadata, query, oracle out, oracle lse) of the case's decode rows."""
    from meshserve.attention.mla.layer import split_prefill_decode

    ref_out, ref_lse = mla_oracle(case)
    _, meta = split_prefill_decode(case.metadata)
    npt = case.metadata.num_prefill_tokens
    return meta, case.query[npt:], ref_out[npt:], ref_lse[npt:]


# (value_split, prefetch): one program or two splitting the columns; tiles through Triton's
# pipeline or loaded into registers a tile ahead.
VARIANTS = {"v1": (1, False), "v2": (2, False), "v1_prefetch": (1, True), "v2_prefetch": (2, True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("partition", [None, 16])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flashmla_decode_matches_float64_oracle(name, partition, variant):
    sc = SCENARIOS[name]
    case = decode_case(sc, seed=5)
    meta, query, ref_out, ref_lse = decode_only(case)
    value_split, prefetch = VARIANTS[variant]
    cfg = flashmla_decode_config(sc.num_heads, "float32", "cpu", value_split=value_split, prefetch=prefetch)
    backend = TritonMLADecodeBackend(sc.problem(), config=cfg, partition=partition)
    plan = backend.plan(meta)
    if partition is not None:
        assert plan.num_splits == -(-max(meta.seq_lens_host) // 16)  # forced splits do run
    out, lse = backend.forward(query, case.cache, plan, case.weights, return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)
    if variant != "v2":
        return
    # The shared-rows kernel on the same plan shape gives the same numbers (up to fp32 order).
    default = TritonMLADecodeBackend(sc.problem(), config=decode_config(sc.num_heads, "float32", "cpu"),
                                     partition=partition)  # fmt: skip
    torch.testing.assert_close(out, default.forward(query, case.cache, default.plan(meta), case.weights),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("block_n", [32, 64])
def test_tiles_longer_than_a_page_look_up_each_row(block_n, prefetch):
    """Pages of 16 with 32- or 64-key tiles: each tile spans pages (a block id per key)."""
    sc = replace(PAGE64, name="page16_long_tiles", block_size=16)
    case = decode_case(sc, seed=6)
    meta, query, ref_out, ref_lse = decode_only(case)
    cfg = flashmla_decode_config(sc.num_heads, "float32", "cpu", value_split=2, block_n=block_n, prefetch=prefetch)
    backend = TritonMLADecodeBackend(sc.problem(), config=cfg, partition=block_n)
    out, lse = backend.forward(query, case.cache, backend.plan(meta), case.weights, return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_graph_plan_serves_shorter_rows(variant):
    """plan_for_graph at max_model_len over static buffers, then the real lengths and tables written
    into them (a replay): each row over the fixed splits by its own length, NaN-poisoned partials
    of empty splits never read, both column parts written."""
    sc = PAGE64
    case = decode_case(sc, seed=7)
    meta, query, ref_out, ref_lse = decode_only(case)
    n, longest = meta.num_decodes, sc.max_model_len
    seq_lens = torch.ones(n, dtype=torch.int32)
    table = torch.zeros(n, longest // sc.block_size, dtype=torch.int32)
    static = replace(meta, seq_lens=seq_lens, block_table=table, seq_lens_host=(longest,) * n, max_seq_len=longest)
    value_split, prefetch = VARIANTS[variant]
    cfg = flashmla_decode_config(sc.num_heads, "float32", "cpu", value_split=value_split, prefetch=prefetch)
    backend = TritonMLADecodeBackend(sc.problem(), config=cfg)
    plan = backend.plan_for_graph(static)
    assert plan.partition == 0 and plan.num_splits > 1
    seq_lens.copy_(meta.seq_lens)
    table[:, : meta.block_table.shape[1]] = meta.block_table
    plan.partial_o.fill_(float("nan"))
    out, lse = backend.forward(query, case.cache, plan, case.weights, return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse, torch.float32)
    used = torch.isfinite(plan.partial_lse).any(-1).sum(0).tolist()
    bn, ns = cfg.block_n, plan.num_splits
    assert used == [math.ceil(k / (math.ceil(math.ceil(k / ns) / bn) * bn)) for k in meta.seq_lens.tolist()]


def test_flashmla_is_the_default_only_where_it_was_measured():
    """CUDA sm_90+, 16-bit latents, >= 64 heads: FlashMLA's cut with 64-key tiles at 2 stages; anywhere else
    (CPU, fp32, FP8 latents, few heads, older GPUs) the shared-rows kernel."""
    for device, dtype in (("cuda", "bfloat16"), ("cuda", "float32"), ("cpu", "float32")):
        assert decode_config(128, dtype, device).kernel is MLADecodeKernel.SHARED_ROWS
    chosen = measured_decode_config(128, "bfloat16", "cuda", False, (9, 0))
    assert (chosen.kernel, chosen.value_split, chosen.block_h, chosen.block_n, chosen.num_warps,
            chosen.num_stages) == (MLADecodeKernel.FLASHMLA, 1, 64, 64, 8, 2)  # fmt: skip
    for args in ((128, "float32", "cuda", False, (9, 0)), (128, "bfloat16", "cuda", True, (9, 0)),
                 (16, "bfloat16", "cuda", False, (9, 0)), (128, "bfloat16", "cuda", False, (8, 0)),
                 (128, "float32", "cpu", False, None)):  # fmt: skip
        assert measured_decode_config(*args) == decode_config(*args[:3]), args
    cfg = flashmla_decode_config(128, "bfloat16", "cuda")
    assert (cfg.kernel, cfg.value_split, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages) == (
        MLADecodeKernel.FLASHMLA, 1, 64, 32, 8, 3)
    with pytest.raises(ConfigError, match="value_split"):
        MLADecodeConfig(64, 32, 8, 2, 2, 256, value_split=2)  # the shared-rows kernel keeps every column
    with pytest.raises(ConfigError, match="value_split"):
        flashmla_decode_config(128, "bfloat16", "cuda", value_split=4)
    with pytest.raises(ConfigError, match="prefetch"):
        MLADecodeConfig(64, 32, 8, 2, 2, 256, prefetch=True)
