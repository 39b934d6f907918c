"""Step plans through msgpack: every field comes back equal, long id lists travel as bytes."""

from __future__ import annotations

import random

import msgpack
import numpy as np

from meshserve.core.outputs import TokenLogprobs
from meshserve.core.sampling_params import SamplingParams
from meshserve.workers.step import (
    PACKED_IDS_MIN,
    DecodeRows,
    NewRequest,
    SampledToken,
    ScheduledSeq,
    StepOutput,
    StepPlan,
)


def test_plans_round_trip_with_long_lists_as_bytes():
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(0, 2**31 - 1) for _ in range(n)]

    long, short = PACKED_IDS_MIN + 5, PACKED_IDS_MIN - 1
    plan = StepPlan(
        7,
        [ScheduledSeq("prompt", ids(long), 0, [ids(long), ids(3)]),
         ScheduledSeq("chunk", ids(short), 40, [ids(2), []], sample=False, table_offsets=[3, 0]),
         ScheduledSeq("decode", [], 99, [[], []], from_last_step=True, table_offsets=[7, 7])],
        new_requests=[NewRequest("prompt", ids(long), SamplingParams(max_tokens=3).to_dict(), ids(short)),
                      NewRequest("x", [], {}, ids(long))],
        finished=["old"], copies=[(3, 4)],
    )  # fmt: skip
    data = plan.to_msgpack()
    back = StepPlan.from_msgpack(data)
    assert back == plan
    raw = msgpack.unpackb(data)
    assert isinstance(raw["seqs"][0][1], bytes) and isinstance(raw["seqs"][0][3][0], bytes)  # long: bytes
    assert isinstance(raw["seqs"][0][3][1], bytes)  # a whole table set goes as bytes, short groups too
    assert isinstance(raw["seqs"][1][1], list) and isinstance(raw["seqs"][1][3][0], list)  # short changes: lists
    assert isinstance(raw["new"][0][1], bytes) and isinstance(raw["new"][1][3], bytes)
    assert len(data) < 4 * 3 * long + 1000  # about 4 bytes per long-list id, not up to 5


def test_decode_rows_travel_as_columns_and_read_back_as_seqs():
    """A plan's columnar decode rows: bytes on the wire (no message per row), equal after the trip,
    and as ScheduledSeqs (after the plan's other seqs) exactly the rows they stand for."""
    n = 300
    rng = np.random.default_rng(0)
    last = rng.random(n) < 0.7
    tokens = np.where(last, 0, rng.integers(1, 2**31 - 1, n))
    rows = DecodeRows([f"r{i}" for i in range(n)], tokens, rng.integers(1, 2**31 - 1, n), last,
                      rng.integers(0, 5000, (n, 2)))
    chunk = ScheduledSeq("c", [5, 6], 10, [[1], [2]], sample=False, table_offsets=[0, 0])
    plan = StepPlan(3, [chunk], decodes=rows)
    data = plan.to_msgpack()
    assert StepPlan.from_msgpack(data) == plan
    assert StepPlan.from_msgpack(data) != StepPlan(3, [chunk], decodes=DecodeRows(
        rows.request_ids, tokens + 1, rows.context_lens, last, rows.table_lens))
    wire = msgpack.unpackb(data)["decodes"]
    assert all(isinstance(w, bytes) for w in (wire[1], wire[2], wire[3], wire[5]))
    assert len(data) < n * (4 * 5 + 1 + 6) + 500  # ids + 4 bytes per int + a flag byte
    seqs = StepPlan.from_msgpack(data).all_seqs()
    assert seqs[0] == chunk and len(seqs) == n + 1
    for i, s in enumerate(seqs[1:]):
        assert s == ScheduledSeq(f"r{i}", [] if last[i] else [int(tokens[i])], int(rows.context_lens[i]), [[], []],
                                 True, bool(last[i]), rows.table_lens[i].tolist())
        assert s.is_decode and s.num_new_tokens == 1
    assert plan.num_new_tokens == 2 + n


def test_step_outputs_round_trip_as_columns():
    lp = TokenLogprobs(5, -0.5, ((5, -0.5), (2, -1.5)))
    out = StepOutput.of(4, [SampledToken("a", 5, lp), SampledToken("b", 1), SampledToken("c", 9)])
    assert (out.request_ids, out.token_ids, out.logprobs) == (["a", "b", "c"], [5, 1, 9], {0: lp})
    back = StepOutput.from_msgpack(out.to_msgpack())
    assert back == out
    assert back.sampled == [SampledToken("a", 5, lp), SampledToken("b", 1), SampledToken("c", 9)]
