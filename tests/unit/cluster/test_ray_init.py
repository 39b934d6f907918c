"""ray_init starts an embedded cluster again (with back-off) when one of Ray's start-up deadlines
passed (seen on a loaded 2-core CI machine), and only then; after the last attempt the cause is
one UnavailableError. A fake Ray counts the calls (the real one: test_ray_start_failure.py)."""

from types import SimpleNamespace

import pytest

import meshserve.cluster.executors.ray_executor as rx
import meshserve.cluster.executors.ray_reaper as reaper
from meshserve.errors import UnavailableError

GCS_PORT = Exception("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc. ")
TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures, self.inits, self.shutdowns = list(failures), 0, 0
        self.util = SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake(monkeypatch):
    def install(failures):
        ray = FakeRay(failures)
        monkeypatch.setattr(rx, "ray", ray)
        monkeypatch.setattr(rx, "START_BACKOFF_S", 0.0)
        monkeypatch.setattr(reaper, "start_reaper", lambda: None)  # nothing real was started
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return ray
    return install


@pytest.mark.parametrize("failure", [TIMEOUT, GCS_PORT, TimeoutError("GCS did not answer")])
def test_a_start_up_timeout_is_retried(fake, failure):
    ray = fake([failure, failure])
    assert rx.ray_init(num_cpus=2) is True
    assert (ray.inits, ray.shutdowns) == (3, 2)


def test_the_last_timeout_is_one_line_naming_the_cause(fake):
    ray = fake([TIMEOUT, GCS_PORT, GCS_PORT])
    with pytest.raises(UnavailableError, match=r"did not start \(3 attempts\): Timed out waiting for file") as info:
        rx.ray_init(num_cpus=2)
    assert "\n" not in str(info.value)
    assert (ray.inits, ray.shutdowns) == (3, 3)


def test_other_errors_are_not_retried(fake):
    ray = fake([ValueError("num_cpus must be positive")])
    with pytest.raises(ValueError, match="num_cpus"):
        rx.ray_init(num_cpus=-1)
    assert (ray.inits, ray.shutdowns) == (1, 1)  # what the failed start left is cleaned up, once
