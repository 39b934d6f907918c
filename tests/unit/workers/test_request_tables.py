"""The worker's persistent block tables (workers/request_tables.py) against the list definition
of a plan's table changes (workers/step.py: apply_table_changes), on random plans: whole tables,
appended blocks, a replaced last block, no change, a cut; requests coming and going so that
rows are reused and both dimensions grow."""

from __future__ import annotations

import random

import numpy as np
import pytest

from meshserve.errors import ConfigError
from meshserve.workers.request_tables import RequestTables
from meshserve.workers.step import CachedRows, ScheduledSeq, apply_table_changes


def _change(rng: random.Random, rid: str, held: list[list[int]] | None, groups: int) -> ScheduledSeq:
    """A random plan entry for `rid` given the tables the worker holds (None: none yet)."""
    def blocks(k: int) -> list[int]:
        return [rng.randrange(1, 10_000) for _ in range(k)]

    if held is None or rng.random() < 0.1:
        return ScheduledSeq(rid, [1], 0, [blocks(rng.randrange(0, 40)) for _ in range(groups)])
    tables, offsets = [], []
    for t in held:
        kind = rng.choice(["none", "none", "append", "cow", "cut"])
        if kind == "none":
            offsets.append(len(t))
            tables.append([])
        elif kind == "append":
            offsets.append(max(len(t) - 1, 0))
            tables.append(t[offsets[-1]:] + blocks(rng.randrange(1, 3)))
        elif kind == "cow":
            offsets.append(max(len(t) - 1, 0))
            tables.append(blocks(1))
        else:
            offsets.append(rng.randrange(0, len(t) + 1))
            tables.append([])
    return ScheduledSeq(rid, [1], 5, tables, table_offsets=offsets)


def _apply(tables: RequestTables, seqs: list[ScheduledSeq]) -> None:
    """A plan's changes for these rows as the runner applies them: checked, then written."""
    if not seqs:
        return
    cached = CachedRows.from_seqs(seqs)
    rows = np.array([tables.row_of[s.request_id] for s in seqs], np.int64)
    tables.check_changes(rows, cached.request_ids, cached.table_offsets)
    tables.apply_rows(rows, cached.table_offsets, cached.block_counts, cached.blocks)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_rows_equal_the_list_definition(groups, seed):
    rng = random.Random(seed)
    tables = RequestTables(groups, rows=2, width=4)  # small: both dimensions must grow
    oracle: dict[str, list[list[int]]] = {}
    next_id = 0
    for _ in range(120):
        if oracle and rng.random() < 0.15:  # a request finishes: its row is reused later
            rid = rng.choice(sorted(oracle))
            del oracle[rid]
            tables.remove(rid)
        for _ in range(rng.randrange(0, 3)):
            rid = f"r{next_id}"
            next_id += 1
            tables.add(rid)
            oracle[rid] = None
        step = [_change(rng, rid, held, groups) for rid, held in oracle.items()]
        _apply(tables, step)
        for s in step:
            oracle[s.request_id] = apply_table_changes(oracle[s.request_id] or [[] for _ in range(groups)], s)
        for rid, held in oracle.items():
            assert tables.table_of(rid) == held
        if oracle:
            rids = list(oracle)
            rows = np.array([tables.row_of[r] for r in rids])
            for g in range(groups):
                got = tables.gather(rows, g)
                assert got.shape[1] == max(max(len(oracle[r][g]) for r in rids), 1)
                for i, r in enumerate(rids):
                    assert got[i, : len(oracle[r][g])].tolist() == oracle[r][g]
    assert len(set(tables.row_of.values())) == len(tables.row_of)  # no two requests share a row


def test_bad_changes_name_the_field_and_change_nothing():
    tables = RequestTables(2)
    tables.add("a")
    tables.apply(ScheduledSeq("a", [1], 0, [[4, 5], [6]]))
    with pytest.raises(ConfigError, match="table_offsets"):
        _apply(tables, [ScheduledSeq("a", [1], 3, [[], []], table_offsets=[3, 1])])  # past the 2 held
    with pytest.raises(ConfigError, match="block_tables"):
        tables.apply(ScheduledSeq("a", [1], 3, [[7]], table_offsets=[1]))  # one group of two
    assert tables.table_of("a") == [[4, 5], [6]]
    with pytest.raises(ConfigError, match="request_id"):
        tables.add("a")
    with pytest.raises(ConfigError, match="block_tables"):  # too short for 40 tokens at 16 per block
        tables.check_cover(np.array([tables.row_of["a"]]), np.array([40]), 16, ["a"])
    tables.check_cover(np.array([tables.row_of["a"]]), np.array([16]), 16, ["a"])


def test_changes_past_the_held_blocks_name_table_offsets_and_change_nothing():
    """The rows of a plan's CachedRows: an offset past the blocks a row holds (the scheduler thinks
    the workers hold more than they do) is an error naming table_offsets and the request, found
    before any row is written."""
    tables = RequestTables(2)
    for rid, t in (("a", [[4, 5], [6]]), ("b", [[7], [8, 9, 10]])):
        tables.add(rid)
        tables.apply(ScheduledSeq(rid, [1], 0, t))
    quiet_b = ScheduledSeq("b", [1], 3, [[], []], table_offsets=[1, 3])
    _apply(tables, [quiet_b, ScheduledSeq("a", [1], 3, [[], [11]], table_offsets=[2, 1])])
    assert tables.table_of("a") == [[4, 5], [6, 11]] and tables.table_of("b") == [[7], [8, 9, 10]]
    with pytest.raises(ConfigError, match=r"table_offsets.*\[3, 2\].*blocks held for a: \[2, 2\]"):
        _apply(tables, [ScheduledSeq("b", [1], 3, [[12], []], table_offsets=[0, 3]),
                        ScheduledSeq("a", [1], 3, [[], []], table_offsets=[3, 2])])
    assert tables.table_of("a") == [[4, 5], [6, 11]] and tables.table_of("b") == [[7], [8, 9, 10]]
