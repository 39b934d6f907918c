"""Recovery windows: placement waits (forever, or up to --placement-timeout), rebuild backoff with
jitter, and the health a probe sees (readiness follows the pools, liveness fails after a window).

Clocks are injected (no sleeping); the coordinator runs NullWorker ranks on threads.
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from grpc_health.v1 import health_pb2

from meshserve.api.health import INFERENCE_SERVICE, HealthReporter
from meshserve.cluster.pools import REBUILD_BACKOFF_S, rebuild_delay
from meshserve.cluster.service import ServiceHealth
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ReplicaFailedError, UnavailableError
from tests.null_worker import POISON_TOKEN
from tests.unit.cluster.cases import collect, serve, wait_until

ray_executor = pytest.importorskip("meshserve.cluster.executors.ray_executor")


class FakeClock:
    """Time moves only when poll() is called: each poll 'blocks' for the seconds it is given."""

    def __init__(self, placed_after: float | None) -> None:
        self.now = 1000.0
        self.placed_after = placed_after
        self.polls: list[float] = []

    def __call__(self) -> float:
        return self.now

    def poll(self, seconds: float) -> bool:
        self.polls.append(seconds)
        self.now += seconds
        return self.placed_after is not None and self.now - 1000.0 >= self.placed_after


def test_placement_waits_forever_by_default_and_logs_progress(caplog):
    clock = FakeClock(placed_after=95.0)
    with caplog.at_level(logging.WARNING, logger="meshserve.ray"):
        ray_executor.wait_placed(clock.poll, timeout_s=None, what=lambda: "unified-0: no node yet",
                                 period_s=30.0, clock=clock)
    assert clock.now - 1000.0 == 95.0 and max(clock.polls) <= 1.0  # a stop is noticed within a second
    progress = [r.getMessage() for r in caplog.records]
    assert progress == [f"unified-0: no node yet; waiting {s} s so far" for s in (30, 60, 90)]


def test_placement_timeout_fails_after_exactly_that_time_naming_the_flag():
    clock = FakeClock(placed_after=None)
    with pytest.raises(UnavailableError, match=r"unified-0: no node yet; gave up after --placement-timeout=7.5 s"):
        ray_executor.wait_placed(clock.poll, timeout_s=7.5, what=lambda: "unified-0: no node yet", clock=clock)
    assert clock.now - 1000.0 == 7.5


def test_placement_that_succeeds_within_the_timeout_returns():
    clock = FakeClock(placed_after=3.0)
    ray_executor.wait_placed(clock.poll, timeout_s=10.0, what=lambda: "x", clock=clock)
    assert clock.now - 1000.0 == 3.0


def test_rebuild_backoff_is_capped_at_10s_and_jittered():
    rng = random.Random(7)
    for attempt in range(50):
        base = REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S) - 1)]
        delays = [rebuild_delay(attempt, rng=rng) for _ in range(20)]
        assert all(base / 2 <= d <= base <= 10.0 for d in delays), (attempt, delays)
        if base > 0:  # slots that failed together spread out
            assert len(set(delays)) == len(delays)


class FakeService:
    def __init__(self) -> None:
        self.state = ServiceHealth(False, 0, 1, "starting", unserving_s=None, degraded_s=None)

    def health(self) -> ServiceHealth:
        return self.state


async def _status(reporter: HealthReporter, service: str) -> str:
    reply = await reporter.servicer.Check(health_pb2.HealthCheckRequest(service=service), None)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_liveness_holds_while_starting_and_fails_only_after_the_window():
    async def main():
        service = FakeService()
        reporter = HealthReporter(service, interval=3600, unhealthy_liveness_s=60)
        await reporter.start()
        states = []

        async def observe(state: ServiceHealth) -> None:
            service.state = state
            await reporter.update()
            states.append((await _status(reporter, ""), await _status(reporter, INFERENCE_SERVICE)))

        await observe(ServiceHealth(False, 0, 1, "starting", unserving_s=None, degraded_s=None))  # never served
        await observe(ServiceHealth(True, 1, 1))
        await observe(ServiceHealth(False, 0, 1, "unified-0 failed", unserving_s=59.9, degraded_s=59.9))
        await observe(ServiceHealth(False, 0, 1, "unified-0 failed", unserving_s=60.1, degraded_s=60.1))
        await observe(ServiceHealth(True, 1, 1))
        await reporter.stop()
        return states

    assert asyncio.run(main()) == [("SERVING", "NOT_SERVING"), ("SERVING", "SERVING"), ("SERVING", "NOT_SERVING"),
                                   ("NOT_SERVING", "NOT_SERVING"), ("SERVING", "SERVING")]


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_coordinator_health_counts_unserving_time_and_rebuilds(tmp_path):
    from tests.unit.cluster.test_coordinator import null_config

    async def body(c):
        before = c.health()
        assert (before.serving, before.unserving_s, before.degraded_s, before.num_rebuilds) == (True, 0.0, 0.0, 0)
        with pytest.raises(ReplicaFailedError):
            await collect(c, "poison", [1, POISON_TOKEN], GREEDY)
        failed = c.health()  # the slot is being rebuilt (or already is): then time since it last served
        assert failed.serving or failed.unserving_s > 0.0
        await wait_until(lambda: c.health().serving, "unified-0 to be rebuilt", timeout_s=30, state=c.health)
        after = c.health()
        assert (after.unserving_s, after.degraded_s, after.num_rebuilds, after.num_rebuild_failures) == (0, 0, 1, 0)

    serve(null_config(tmp_path), body)


def test_models_before_start_is_unavailable_not_a_crash(tmp_path):
    from meshserve.cluster.coordinator import Coordinator
    from tests.unit.cluster.test_coordinator import null_config

    c = Coordinator(null_config(tmp_path))
    with pytest.raises(UnavailableError, match="the service is starting"):
        c.models()
    h = c.health()
    assert (h.serving, h.unserving_s, h.degraded_s) == (False, None, None)
