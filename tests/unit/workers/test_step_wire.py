"""Step plans through msgpack: every field comes back equal, long id lists travel as bytes."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from meshserve.core.outputs import TokenLogprobs
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError
from meshserve.workers.step import (
    PACKED_IDS_MIN,
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
    prompt = ids(long)
    plan = StepPlan.from_seqs(
        7,
        [ScheduledSeq("prompt", prompt[2:], 2, [ids(long), ids(3)]),
         ScheduledSeq("chunk", ids(short), 40, [ids(2), []], sample=False, table_offsets=[3, 0]),
         ScheduledSeq("decode", [], 99, [[], []], from_last_step=True, table_offsets=[7, 7])],
        [NewRequest("prompt", prompt, SamplingParams(max_tokens=3).to_dict(), ids(short))],
        finished=["old"], copies=[(3, 4)],
    )  # fmt: skip
    assert [r.request_id for r in plan.new_requests] == ["prompt"] and plan.cached.request_ids == ["chunk", "decode"]
    data = plan.to_msgpack()
    back = StepPlan.from_msgpack(data)
    assert back == plan
    assert back.new_requests[0].token_ids == prompt[2:] and back.new_requests[0].context_len == 2
    raw = msgpack.unpackb(data)
    assert isinstance(raw["new"][0][1], bytes) and isinstance(raw["new"][0][3], list)  # long: bytes; short: list
    assert all(isinstance(t, bytes) for t in raw["new"][0][8])  # a whole table set goes as bytes, short groups too
    assert all(isinstance(w, bytes) for w in raw["cached"][1:5] + raw["cached"][6:9])  # columns: bytes
    assert len(data) < 4 * 3 * long + 1000  # about 4 bytes per long-list id, not up to 5
    with pytest.raises(ConfigError, match="new_requests"):
        StepPlan.from_seqs(0, [], [NewRequest("x", [], {}, ids(long))])  # announced without a row
    with pytest.raises(ConfigError, match="seqs"):
        StepPlan.from_seqs(0, [ScheduledSeq("x", [5], 0, [[1]])], [NewRequest("x", [6], {})])  # not its prompt


def test_cached_rows_travel_as_columns_and_read_back_as_seqs():
    """A plan's cached rows: bytes on the wire (no message per row), equal after the trip, and as
    ScheduledSeqs (after the new requests' rows) exactly the rows they stand for."""
    n = 300
    rng = np.random.default_rng(0)
    last = rng.random(n) < 0.7
    tokens = rng.integers(1, 2**31 - 1, n)
    contexts = rng.integers(1, 2**31 - 1, n)
    held = rng.integers(0, 5000, (n, 2))
    seqs = [ScheduledSeq(f"r{i}", [] if last[i] else [int(tokens[i])], int(contexts[i]), [[], []], True, bool(last[i]),
                         held[i].tolist()) for i in range(n)]  # fmt: skip
    chunk = ScheduledSeq("c", [5, 6], 10, [[1], [2]], sample=False, table_offsets=[0, 0])
    plan = StepPlan.from_seqs(3, [chunk, *seqs])
    data = plan.to_msgpack()
    assert StepPlan.from_msgpack(data) == plan
    other = StepPlan.from_seqs(3, [chunk, *seqs[:-1], ScheduledSeq(**{**_fields(seqs[-1]), "context_len": 1})])
    assert StepPlan.from_msgpack(data) != other
    assert len(data) < n * (4 * 6 + 1 + 6) + 500  # ids + 4 bytes per int + a flag byte
    back = StepPlan.from_msgpack(data).all_seqs()
    assert back == [chunk, *seqs]
    assert all(s.is_decode and s.num_new_tokens == 1 for s in back[1:])
    assert plan.num_new_tokens == 2 + n


def _fields(seq: ScheduledSeq) -> dict:
    return {f: getattr(seq, f) for f in ScheduledSeq.__slots__}


def test_step_outputs_round_trip_as_columns():
    lp = TokenLogprobs(5, -0.5, ((5, -0.5), (2, -1.5)))
    out = StepOutput.of(4, [SampledToken("a", 5, lp), SampledToken("b", 1), SampledToken("c", 9)])
    assert (out.request_ids, out.token_ids, out.logprobs) == (["a", "b", "c"], [5, 1, 9], {0: lp})
    back = StepOutput.from_msgpack(out.to_msgpack())
    assert back == out
    assert back.sampled == [SampledToken("a", 5, lp), SampledToken("b", 1), SampledToken("c", 9)]


def test_grammar_announcements_and_outcomes_travel():
    """A request waiting for its grammar is announced without a row (no row in all_seqs); the
    driver's compile outcomes come back in the step output."""
    plan = StepPlan(5, [NewRequest("g", list(range(40)), SamplingParams(max_tokens=3).to_dict(), num_tokens=0,
                                   sample=False, grammar_timeout_s=2.5)])
    back = StepPlan.from_msgpack(plan.to_msgpack())
    assert back == plan and back.new_requests[0].is_announcement and back.new_requests[0].grammar_timeout_s == 2.5
    assert back.all_seqs() == [] and back.num_new_tokens == 0
    out = StepOutput(6, grammars_ready=["g"], grammar_errors={"h": "not a grammar"}, grammar_busy={"i": "no capacity"})
    assert StepOutput.from_msgpack(out.to_msgpack()) == out
