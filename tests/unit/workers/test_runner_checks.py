"""A plan's cached rows that do not match the runner's state are refused before anything runs:
an error naming the field and the request, and the runner's requests and tables as they were."""

import numpy as np
import pytest

from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError
from meshserve.workers.runner import ModelRunner
from meshserve.workers.step import CachedRows, NewRequest, ScheduledSeq, StepPlan


class _NoModel:
    """The checks run before any forward pass: a model that must never be called."""

    def __call__(self, *args, **kwargs):
        raise AssertionError("the forward pass ran")


def _rows(ids, *, last=False, held=1, context=3):
    """Decodes that just continue: one token (or the one the previous step draws), no table change."""
    n = len(ids)
    return CachedRows(list(ids), np.full(n, 0 if last else 1, np.int64), np.full(0 if last else n, 7, np.int64),
                      np.full(n, context, np.int64), np.ones(n, bool), np.full(n, last, bool),
                      np.full((n, 1), held, np.int64), np.zeros((n, 1), np.int64), np.zeros(0, np.int64))


def test_bad_decode_rows_name_the_field_and_change_nothing():
    runner = ModelRunner(_NoModel(), backends=[object()], kv_caches=[None], block_size=4, device="cpu")
    runner.announce(NewRequest("a", [1, 2, 3], SamplingParams(temperature=0).to_dict()))
    runner.tables.apply(ScheduledSeq("a", [], 0, [[5]]))  # as a prompt step would have: one block
    before = runner.tables.table_of("a")
    cases = [
        (_rows(["a", "zz"]), "request_id.*zz"),  # never announced
        (_rows(["a"], held=2), "table_offsets.*blocks held for a"),  # the runner holds one block
        (_rows(["a"], last=True), "from_last_step.*a"),  # no previous step drew a token for it
    ]
    for rows, match in cases:
        with pytest.raises(ConfigError, match=match):
            runner.submit(StepPlan(1, cached=rows))
        assert runner.tables.table_of("a") == before and set(runner.requests) == {"a"}
        assert not runner._in_flight  # nothing was queued for collect()
