"""Step plans through msgpack: every field comes back equal, long id lists travel as bytes."""

from __future__ import annotations

import random

import msgpack

from meshserve.core.sampling_params import SamplingParams
from meshserve.workers.step import PACKED_IDS_MIN, NewRequest, ScheduledSeq, StepPlan


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
