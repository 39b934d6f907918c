"""Paced overlap (SchedulerConfig.paced_overlap, cluster/replica.py `_pace`): with overlap, a
request that arrives while a decode step runs joins the next step, not the one after.

A tp=1 replica on a thread whose worker has a simulated device (tests/simulated_device.py: each
step takes DEVICE_MS of "device" time after the one before, the host is free meanwhile). One
request decodes alone; right after one of its tokens is delivered (step k returned: step k+1
runs on the "device"), a second request arrives. Unpaced, step k+1's successor was already
planned without it, so its first token comes with step k+3; paced, the replica waits for
arrivals for most of the last step's slack before planning, so it comes with step k+2. Counted
in the replica's steps (its step counter moves once per DEVICE_MS), not in wall time.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from tests.simulated_device import DEVICE_ENV, WORKER
from tests.unit.cluster.cases import assert_no_held_blocks, serve, threads

DEVICE_MS = 150  # the pacing window is ~0.75 of it: far above the event loop's latency on a loaded CI core
BACKGROUND = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ARRIVAL = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.mark.parametrize(("paced", "steps_to_first_token"), [(False, 3), (True, 2)])
def test_an_arrival_during_a_decode_step_joins_the_next_step_when_paced(tiny_llama, monkeypatch, paced,
                                                                          steps_to_first_token):
    monkeypatch.setenv(DEVICE_ENV, str(DEVICE_MS))
    config = dataclasses.replace(threads(tiny_llama, scheduler=dict(async_scheduling=True, paced_overlap=paced)),
                                 worker_class=WORKER)

    async def body(coord):
        (replica,) = coord.replicas()
        background = coord.generate([5, 6, 7, 8], BACKGROUND, request_id="background").__aiter__()
        tokens = []
        for _ in range(5):  # its prefill, then steady decode steps (the replica has measured a slack)
            tokens += (await background.__anext__()).token_ids
        assert replica.core.decode_slack_s is not None
        arrived_at = replica.counters.steps  # step k returned; k+1 runs, its thread waits in collect
        arrival = coord.generate([9, 10, 11], ARRIVAL, request_id="arrival").__aiter__()
        first = await arrival.__anext__()
        assert first.token_ids
        steps = replica.counters.steps - arrived_at
        rest = [d async for d in arrival]
        tokens += [t async for d in background for t in d.token_ids]
        return steps, first.token_ids + [t for d in rest for t in d.token_ids], rest[-1].finish_reason, tokens

    async def checked(coord):
        out = await body(coord)
        assert_no_held_blocks(coord)
        return out

    steps, arrival_tokens, reason, background_tokens = serve(config, checked)
    assert steps == steps_to_first_token
    assert len(arrival_tokens) == 2 and reason is FinishReason.LENGTH
    assert len(background_tokens) == BACKGROUND.max_tokens
