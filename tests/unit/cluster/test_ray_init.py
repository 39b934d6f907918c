"""ray_init starts an embedded cluster again (with back-off) when one of Ray's start-up deadlines
passed (seen on a loaded 2-core CI machine), and only then; after the last attempt the cause is
one UnavailableError. An embedded start picks its node address with Ray's cluster flag off (the
node is 127.0.0.1, so Ray's servers bind loopback), a join does not, and the flag is Ray's own
again afterwards. A fake Ray counts the calls and notes the flag at each init (the real one:
test_ray_start_failure.py, test_listen_loopback.py)."""

from types import SimpleNamespace

import pytest
from ray._private import ray_constants

import meshserve.cluster.executors.ray_executor as rx
import meshserve.cluster.executors.ray_reaper as reaper
from meshserve.errors import UnavailableError

GCS_PORT = Exception("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc. ")
TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures, self.inits, self.shutdowns = list(failures), 0, 0
        self.cluster_flag_at_init: list[bool] = []
        self.util = SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.inits += 1
        self.cluster_flag_at_init.append(ray_constants.ENABLE_RAY_CLUSTER)
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
        monkeypatch.setattr(reaper, "start_reaper", lambda roots: None)  # nothing real was started
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


def test_an_embedded_start_picks_its_address_with_ray_clusters_off_and_restores_the_flag(fake):
    was = ray_constants.ENABLE_RAY_CLUSTER
    ray = fake([GCS_PORT])
    rx.ray_init(num_cpus=2)
    assert ray.cluster_flag_at_init == [False, False]
    assert ray_constants.ENABLE_RAY_CLUSTER is was


def test_a_join_picks_its_address_as_ray_does(fake, monkeypatch):
    monkeypatch.setattr(rx, "probe_cluster", lambda address: None)
    ray = fake([])
    rx.ray_init("127.0.0.2:6390")
    assert ray.cluster_flag_at_init == [ray_constants.ENABLE_RAY_CLUSTER]
