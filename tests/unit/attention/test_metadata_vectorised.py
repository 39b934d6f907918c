"""AttentionMetadata.build (numpy, no per-token Python) against a plain per-sequence construction.

The oracle below is the straightforward reading of the layout (docs/architecture.md): walk each
sequence, each new token, look its block up in the row. Batches are random: whole prompts,
chunks of a longer prompt after cached context (chunked prefill), prompts that start after a
prefix-cache hit, decodes; block tables shuffled, with spare blocks at the end of some rows and
stale ids at the front of windowed rows; DCP ranks; K/V writes off.
"""

import random

import pytest
import torch

from meshserve.attention.metadata import AttentionMetadata
from meshserve.errors import ConfigError


def oracle(query_lens, seq_lens, block_tables, block_size, *, write_kv=True, dcp_size=1, dcp_rank=0):
    """What each field must hold, built one sequence and one token at a time."""
    qsl, slots, context, prefills = [0], [], [], 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        qsl.append(qsl[-1] + q)
        context.append(s - q)
        if not (q == 1 and s > 1):
            prefills = i + 1
        for pos in range(s - q, s):
            if write_kv and pos % dcp_size == dcp_rank:
                local = pos // dcp_size
                slots.append(block_tables[i][local // block_size] * block_size + local % block_size)
            else:
                slots.append(-1)
    width = max(max(len(r) for r in block_tables), 1)
    table = [list(r) + [0] * (width - len(r)) for r in block_tables]
    return dict(qsl=qsl, slots=slots, context=context, table=table, num_prefills=prefills,
                num_prefill_tokens=sum(query_lens[:prefills]))


def random_batch(rng: random.Random, block_size: int, dcp_size: int, window: int | None):
    """(query_lens, seq_lens, block_tables): prefills (whole, chunked, after a prefix hit) then decodes."""
    num_prefills, num_decodes = rng.randint(0, 5), rng.randint(0, 40)
    if num_prefills + num_decodes == 0:
        num_decodes = 1
    query_lens, seq_lens = [], []
    for _ in range(num_prefills):
        kind = rng.choice(["whole", "chunk", "prefix_hit"])
        q = rng.randint(1, 70)
        if kind == "whole":
            cached = 0
        elif kind == "prefix_hit":  # whole cached blocks
            cached = rng.randint(1, 5) * block_size
        else:  # a later chunk of a long prompt
            cached = rng.randint(1, 90)
        query_lens.append(q)
        seq_lens.append(cached + q)
    for _ in range(num_decodes):
        query_lens.append(1)
        seq_lens.append(rng.randint(2, 300))
    blocks = list(range(20000))
    rng.shuffle(blocks)
    tables = []
    for s in seq_lens:
        local = (s + dcp_size - 1) // dcp_size
        n = -(-local // block_size) + rng.choice([0, 0, 1, 3])  # some rows hold spare blocks
        row = [blocks.pop() for _ in range(n)]
        if window is not None:  # blocks released by the window keep stale ids the workers never read
            stale = max(0, (s - window) // (block_size * dcp_size) - 1)
            row[:stale] = [rng.randrange(4096) for _ in range(stale)]
        tables.append(row)
    return query_lens, seq_lens, tables


@pytest.mark.parametrize("seed", range(40))
def test_build_equals_per_sequence_oracle(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    dcp_size = rng.choice([1, 1, 2, 4])
    dcp_rank = rng.randrange(dcp_size)
    window = rng.choice([None, 8, 33])
    write_kv = rng.random() > 0.1
    query_lens, seq_lens, tables = random_batch(rng, block_size, dcp_size, window)
    kw = dict(write_kv=write_kv, dcp_size=dcp_size, dcp_rank=dcp_rank)
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                   block_size=block_size, **kw)
    want = oracle(query_lens, seq_lens, tables, block_size, **kw)
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == want["qsl"]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == seq_lens
    assert meta.context_lens.dtype == torch.int32 and meta.context_lens.tolist() == want["context"]
    assert meta.block_table.dtype == torch.int32 and meta.block_table.tolist() == want["table"]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == want["slots"]
    assert (meta.num_prefills, meta.num_prefill_tokens) == (want["num_prefills"], want["num_prefill_tokens"])
    assert meta.num_decodes == len(query_lens) - want["num_prefills"]
    assert (meta.max_query_len, meta.max_seq_len) == (max(query_lens), max(seq_lens))
    assert meta.query_lens_host == tuple(query_lens) and meta.seq_lens_host == tuple(seq_lens)


def test_encoder_tables_are_padded_like_the_oracle():
    rows = [[7, 3], [], [9, 1, 4]]
    meta = AttentionMetadata.build(query_lens=[1, 1, 1], seq_lens=[2, 3, 2], block_tables=[[0], [1], [2]],
                                   block_size=4, encoder_seq_lens=[5, 0, 9], encoder_block_tables=rows)
    assert meta.encoder_block_table.tolist() == [[7, 3, 0], [0, 0, 0], [9, 1, 4]]


@pytest.mark.parametrize("seed", range(10))
def test_first_bad_sequence_is_named(seed):
    """With several bad sequences, the error names the first, as a check per sequence does."""
    rng = random.Random(seed)
    query_lens, seq_lens, tables = random_batch(rng, 4, 1, None)
    n = len(query_lens)
    bad = sorted(rng.sample(range(n), min(n, 2)))
    for i in bad:
        tables[i] = tables[i][: max(0, -(-seq_lens[i] // 4) - 1)]  # one block short
    with pytest.raises(ConfigError) as err:
        AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=4)
    assert err.value.field == f"block_tables[{bad[0]}]"
    assert f">= {-(-seq_lens[bad[0]] // 4)} blocks" in str(err.value)
