"""Cache tensors from a memory budget; copy-on-write copies."""

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.spec import AttentionSpec, AttentionType, KVCacheDtype, MLADims
from meshserve.errors import ConfigError
from meshserve.kvstore.cache_tensors import (
    MLACache,
    allocate_caches,
    allocate_caches_for_budget,
    block_bytes,
    copy_blocks,
    num_blocks_for_budget,
)

GQA = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=16)
FP8 = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=16, kv_cache_dtype=KVCacheDtype.FP8_E4M3)
MLA = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=24, mla=MLADims(32, 16, 8, 16))
ENC = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=8, attn_type=AttentionType.ENCODER_ONLY)


def test_block_bytes_counts_every_layer_by_its_own_layout():
    bs = 16
    gqa = 2 * bs * 2 * 16 * 2  # K and V, bf16
    fp8 = 2 * bs * 2 * 16 * 1
    mla = bs * (32 + 8) * 2  # one latent vector per token
    assert block_bytes([GQA, FP8, MLA, ENC], bs, "bfloat16") == gqa + fp8 + mla
    assert block_bytes([GQA], bs, "float32", tp_size=2) == 2 * bs * 1 * 16 * 4  # heads split
    assert block_bytes([GQA], bs, "float32", tp_size=4) == 2 * bs * 1 * 16 * 4  # replicated


def test_budget_gives_the_most_blocks_that_fit():
    per = block_bytes([GQA, MLA], 16, "float16")
    assert num_blocks_for_budget([GQA, MLA], 16, "float16", per * 37 + per - 1) == 37
    with pytest.raises(ConfigError, match="memory_bytes"):
        num_blocks_for_budget([GQA], 16, "float16", per)
    with pytest.raises(ConfigError, match="tp_size"):
        block_bytes([AttentionSpec(num_heads=6, num_kv_heads=6, head_size=8)], 16, "float16", tp_size=4)


def test_allocated_caches_have_the_backend_layouts():
    n, caches = allocate_caches_for_budget(
        [GQA, FP8, MLA, ENC], memory_bytes=1 << 20, block_size=8, dtype="bfloat16"
    )
    gqa, fp8, mla, enc = caches
    assert (
        isinstance(gqa, KVCache) and gqa.data.shape == (n, 2, 8, 2, 16) and gqa.data.dtype == torch.bfloat16
    )
    assert fp8.is_fp8 and fp8.data.dtype == torch.float8_e4m3fn and fp8.k_scale.dtype == torch.float32
    assert isinstance(mla, MLACache) and mla.data.shape == (n, 8, 40) and mla.block_size == 8
    assert enc is None
    used = sum(c.data.numel() * c.data.element_size() for c in caches if c is not None)
    assert used <= 1 << 20 < used + block_bytes([GQA, FP8, MLA], 8, "bfloat16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [GQA, FP8, MLA], ids=["gqa", "fp8", "mla"])
def test_copy_blocks_copies_every_layer(spec, dtype):
    caches = allocate_caches([spec, spec], num_blocks=6, block_size=4, dtype=dtype)
    for c in caches:
        c.data.copy_(torch.randn(c.data.shape).to(c.data.dtype))
    before = [c.data.clone() for c in caches]
    copy_blocks(caches, [(1, 4), (4, 5)])  # chains read the old contents
    for old, c in zip(before, caches):
        assert torch.equal(c.data[4].view(torch.uint8), old[1].view(torch.uint8))
        assert torch.equal(c.data[5].view(torch.uint8), old[4].view(torch.uint8))
        assert torch.equal(c.data[:4].view(torch.uint8), old[:4].view(torch.uint8))

