"""ray_init starts an embedded cluster a second time when Ray's node start-up deadline passed
(seen on a loaded 2-core CI machine), and only then."""

import pytest

import meshserve.cluster.executors.ray_executor as rx

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures, self.inits, self.shutdowns = list(failures), 0, 0

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
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        return ray
    return install


def test_a_start_up_timeout_is_retried_once(fake):
    ray = fake([TIMEOUT])
    assert rx.ray_init(num_cpus=2) is True
    assert (ray.inits, ray.shutdowns) == (2, 1)


def test_a_second_timeout_is_raised(fake):
    ray = fake([TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match="timed out during startup"):
        rx.ray_init(num_cpus=2)
    assert (ray.inits, ray.shutdowns) == (2, 1)


def test_other_errors_are_not_retried(fake):
    ray = fake([ValueError("num_cpus must be positive")])
    with pytest.raises(ValueError, match="num_cpus"):
        rx.ray_init(num_cpus=-1)
    assert (ray.inits, ray.shutdowns) == (1, 0)
