"""AttentionSpec validation and the packed metadata builder."""

import pytest
import torch

from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.spec import AttentionSpec, AttentionType
from meshserve.errors import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        (dict(num_heads=0), "num_heads", "an integer >= 1"),
        (dict(num_kv_heads=3), "num_kv_heads", "a divisor of num_heads=8"),
        (dict(head_size=0), "head_size", "an integer >= 1"),
        (dict(sliding_window=0), "sliding_window", "an integer >= 1 or None"),
        (dict(num_sink_tokens=4), "num_sink_tokens", "0 unless sliding_window is set"),
        (dict(logits_soft_cap=-1.0), "logits_soft_cap", "a number > 0 or None"),
        (dict(q_scaling=0.0), "q_scaling", "a number > 0"),
        (dict(attn_type="bidirectional"), "attn_type", "one of ['decoder'"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype", "one of ['auto', 'fp8_e4m3', 'fp8_e5m2']"),
        (dict(sliding_window=4, attn_type="encoder"), "attn_type", "'decoder' when sliding_window is set"),
    ],
)
def test_spec_refuses_bad_values(kwargs, field, allowed):
    base = dict(num_heads=8, num_kv_heads=2, head_size=64)
    with pytest.raises(ConfigError) as err:
        AttentionSpec(**(base | kwargs))
    assert err.value.field == field and allowed in str(err.value)


def test_spec_scale_and_enums():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, q_scaling=2.0, attn_type="encoder_only")
    assert spec.softmax_scale == pytest.approx(1 / 16)
    assert spec.attn_type is AttentionType.ENCODER_ONLY and not spec.uses_kv_cache
    assert AttentionSpec(num_heads=1, num_kv_heads=1, head_size=4, scale=0.3).softmax_scale == 0.3


def test_metadata_packs_prefills_then_decodes():
    meta = AttentionMetadata.build(query_lens=[3, 2, 1, 1], seq_lens=[3, 6, 9, 4],
                                   block_tables=[[5], [2, 7], [1, 0, 3], [4]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6, 7]
    assert meta.context_lens.tolist() == [0, 4, 8, 3]
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decodes) == (2, 5, 2)
    assert meta.slot_mapping.tolist() == [20, 21, 22, 28, 29, 12, 19]
    assert meta.block_table.shape == (4, 3) and meta.block_table.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens) == (3, 9, 7)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(query_lens=[1, 3], seq_lens=[5, 3], block_tables=[[0, 1], [2]]), "query_lens"),
        (dict(query_lens=[0], seq_lens=[3], block_tables=[[0]]), "query_lens[0]"),
        (dict(query_lens=[4], seq_lens=[3], block_tables=[[0]]), "seq_lens[0]"),
        (dict(query_lens=[3], seq_lens=[9], block_tables=[[0, 1]]), "block_tables[0]"),
        (dict(query_lens=[3], seq_lens=[3, 4], block_tables=[[0]]), "seq_lens"),
    ],
)
def test_metadata_refuses_bad_batches(kwargs, field):
    with pytest.raises(ConfigError) as err:
        AttentionMetadata.build(block_size=4, **kwargs)
    assert err.value.field == field
