"""Replicas on Ray: tp WorkerActors gang-scheduled in one placement group, steps over the channel.

Placement: one bundle per rank, STRICT_PACK (a replica's ranks share a node: their collectives
stay on one host). A bundle asks for the pool's resource (`meshserve_unified`, `meshserve_prefill`,
`meshserve_decode`, one unit per rank, advertised by worker nodes; see docs/deploy.md) when the
cluster has it, `gpus_per_rank` of a GPU per rank on CUDA (ParallelConfig; 1 by default, a
fraction lets one-rank replicas share a GPU), else a sliver of CPU so that many ranks fit on a
small machine. Before placing anything, check_gpus_suffice refuses a layout whose GPU ranks
cannot fit an embedded cluster (gpu_placement.py). The channel binds on the driver's node IP;
rank 0 picks the torch.distributed rendezvous on its own node.

`ray_init(address)` joins a running cluster (`address`, "auto", or RAY_ADDRESS) or starts an
embedded one on this machine; the same code runs on both. An embedded cluster is a one-node
cluster on 127.0.0.1: its GCS, raylet, object manager and workers listen on loopback only (see
ray_init), so the step channel, the KV export servers, gloo and NIXL/UCX follow it onto loopback.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshserve.cluster.executors.channel_executor import ChannelExecutor
from meshserve.cluster.executors.executor import WorkerDiedError, WorkerSpec
from meshserve.cluster.executors.gpu_placement import PoolDemand, gpu_shortfall
from meshserve.errors import UnavailableError

log = logging.getLogger("meshserve.ray")

CPU_PER_RANK = 0.01  # without pool resources: ranks are placed, not CPU-limited
PLACEMENT_LOG_PERIOD_S = 30.0  # how often a replica still waiting for placement says so


def ray_init(address: str | None = None, *, num_cpus: int | None = None, temp_dir: str | None = None,
             num_gpus: int | None = None) -> bool:
    """Connect to Ray unless already connected. Returns True when this call connected (the
    caller then owns the connection and calls ray_shutdown()). address None starts an embedded
    cluster (unless RAY_ADDRESS is set); "auto" or "host:port" joins an existing one. num_cpus,
    num_gpus: the embedded node's resources (None: Ray counts the machine's).

    An embedded start that times out (Ray's GCS or raylet slow to come up on a loaded machine;
    Ray says so in several ways: START_UP_TIMEOUTS) is tried again after a back-off, up to
    EMBEDDED_START_ATTEMPTS times, then is one UnavailableError naming the cause. Whatever a
    failed start left running is stopped first. A started cluster gets a watchdog (ray_reaper.py)
    that stops its processes if this process dies without ray_shutdown().

    The embedded node's address is 127.0.0.1 (_node_on_loopback): Ray's servers bind loopback
    only on such a node; on any other address (Linux's default: the address of the default
    route) they bind every interface, whatever else they are told."""
    global _reaper
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address is None:
        kwargs.update(include_dashboard=False, num_cpus=num_cpus, num_gpus=num_gpus, _temp_dir=temp_dir)
    if address is not None or os.environ.get("RAY_ADDRESS"):
        probe_cluster(address or os.environ["RAY_ADDRESS"])
        ray.init(address=address, **kwargs)
        return True
    for attempt in range(1, EMBEDDED_START_ATTEMPTS + 1):
        before = _descendants()
        try:
            with _node_on_loopback():
                ray.init(**kwargs)
        except Exception as exc:  # Ray raises bare Exceptions (and TimeoutError) when its GCS or raylet are slow
            ray.shutdown()  # what the failed start registered
            _stop_new(before)  # what it started and did not register (a GCS whose port file never came)
            cause = " ".join(str(exc).split()) or type(exc).__name__
            if not _is_start_up_timeout(exc):
                raise
            if attempt == EMBEDDED_START_ATTEMPTS:
                raise UnavailableError(f"the embedded Ray cluster did not start ({attempt} attempts): {cause} "
                                       "(a loaded machine: try again, or start Ray yourself and pass --ray-address)"
                                       ) from None
            delay = START_BACKOFF_S * 2 ** (attempt - 1)
            log.warning("the embedded Ray cluster did not start in time (%s); trying again in %.0f s", cause, delay)
            time.sleep(delay)
            continue
        from meshserve.cluster.executors.ray_reaper import start_reaper

        _reaper = start_reaper(_descendants() - before)  # Ray's processes, not the server's others
        node = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(node).is_loopback:  # a Ray that changed how it picks the address
            log.warning("the embedded Ray node is on %s, not loopback: its servers listen on every interface", node)
        return True
    raise AssertionError("unreachable")  # the loop returns or raises


@contextlib.contextmanager
def _node_on_loopback():
    """Ray picks a node's address as it starts it: 127.0.0.1 where clusters are off (its
    ENABLE_RAY_CLUSTER, False by default on macOS and Windows, env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER),
    else the address of the default route. `_node_ip_address="127.0.0.1"` does not help: ray.init
    replaces a loopback address by that same pick. Ray's C++ servers (GCS, raylet's node and object
    managers, every core worker) bind 127.0.0.1 exactly when the node's address is 127.0.0.1, and
    0.0.0.0/:: otherwise (measured with psutil on Ray 2.60). The flag is read at the pick, so it
    is turned off for the start of an embedded node only: a later join of a real cluster by this
    process picks its address as usual."""
    from ray._private import ray_constants

    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was


def ray_shutdown() -> None:
    """Disconnect from Ray (stopping an embedded cluster ray_init started, and its watchdog)."""
    global _reaper
    ray.shutdown()
    if _reaper is not None:
        _reaper.close()
        _reaper = None


EMBEDDED_START_ATTEMPTS = 3  # a loaded 2-core machine now and then misses Ray's node start-up deadlines
START_BACKOFF_S = 1.0  # before the second attempt; doubled before each next one
# What Ray's start-up timeouts say (the raylet's registration, the GCS port file, the GCS connection).
START_UP_TIMEOUTS = ("timed out", "failed to connect to gcs", "gcs has become overloaded")
_reaper = None  # ray_reaper.Reaper of the embedded cluster this process started


def _is_start_up_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or any(s in text for s in START_UP_TIMEOUTS)


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop_new(before: set[int]) -> None:
    """Stop (and reap) the descendants of this process that were not there `before`."""
    import psutil

    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in new:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(new, timeout=3.0)  # waiting reaps our own children: no zombie stays
    for p in still:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(still, timeout=3.0)


PROBE_TIMEOUT_S = 4.0  # a join that cannot work fails within this (ray.init itself retries for ~20 s)


def probe_cluster(address: str, *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Ask the cluster's GCS for its id with this process's Ray credentials, before ray.init: a
    cluster that is not there, or one whose token authentication does not match ours, is one
    UnavailableError naming the address and RAY_AUTH_MODE instead of a 20 s retry and a traceback."""
    import grpc
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        SyncAuthenticationMetadataClientInterceptor,
    )
    from ray._private.services import canonicalize_bootstrap_address
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    from ray.exceptions import AuthenticationError

    mode = os.environ.get("RAY_AUTH_MODE") or "unset (Ray's default)"
    try:
        gcs = canonicalize_bootstrap_address(address)
    except Exception as exc:  # Ray raises plain exceptions for an address it cannot parse or find
        raise UnavailableError(f"Ray address {address!r} is not usable: {exc}") from None
    if gcs is None:
        raise UnavailableError(f"no Ray cluster to join at {address!r}: start one with `ray start --head` "
                               "or pass --ray-address HOST:PORT")
    channel = grpc.intercept_channel(grpc.insecure_channel(gcs), SyncAuthenticationMetadataClientInterceptor())
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout)
    except AuthenticationError:
        raise UnavailableError(f"Ray token authentication is on here (RAY_AUTH_MODE={mode}) but no token was found "
                               f"to join {gcs}: set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token "
                               "(`ray get-auth-token` on its head), or RAY_AUTH_MODE=disabled if the cluster runs "
                               "without authentication") from None
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            fix = "this token is not the cluster's:" if mode == "token" else "set RAY_AUTH_MODE=token and"
            raise UnavailableError(f"the Ray cluster at {gcs} runs token authentication and refused this process "
                                   f"(RAY_AUTH_MODE={mode}): {fix} give its token in RAY_AUTH_TOKEN or "
                                   "RAY_AUTH_TOKEN_PATH (`ray get-auth-token` on its head prints it)") from None
        raise UnavailableError(f"cannot reach the Ray cluster at {gcs} ({exc.code().name} within {timeout:.0f} s; "
                               f"RAY_AUTH_MODE={mode}): is `ray start --head` running there, and the port open?"
                               ) from None
    finally:
        channel.close()


def ranks_take_gpus(device: str | None, resources: dict[str, float]) -> bool:
    """Whether ranks reserve GPUs: on CUDA, or with no device named on a cluster that has GPUs."""
    return device == "cuda" or (device is None and resources.get("GPU", 0) > 0)


def rank_bundle(role: str, *, device: str | None, gpus_per_rank: float = 1.0,
                resources: dict[str, float] | None = None) -> dict[str, float]:
    """Resources one rank of a `role` replica reserves (resources: the cluster's, default
    ray.cluster_resources()). A GPU rank reserves gpus_per_rank of one GPU: below 1, Ray places
    several such ranks on one GPU and gives each of their actors that GPU in CUDA_VISIBLE_DEVICES."""
    resources = ray.cluster_resources() if resources is None else resources
    bundle: dict[str, float] = {}
    pool_resource = f"meshserve_{role}"
    if pool_resource in resources:
        bundle[pool_resource] = 1.0
    if ranks_take_gpus(device, resources):
        bundle["GPU"] = gpus_per_rank
    return bundle or {"CPU": CPU_PER_RANK}


def check_gpus_suffice(demands: list[PoolDemand], *, device: str | None, embedded: bool) -> None:
    """Before any replica is placed: when the pools' GPU ranks cannot fit the cluster's GPUs
    (gpu_placement.gpu_shortfall), an embedded cluster (one node that nothing joins) fails at once
    with UnavailableError naming the settings that fix it, instead of a placement group that waits
    forever; a cluster joined by address logs it and waits (an autoscaler may still add nodes;
    --placement-timeout bounds that wait)."""
    resources = ray.cluster_resources()
    if not ranks_take_gpus(device, resources):
        return
    nodes = [node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node.get("Alive")]
    why = gpu_shortfall(demands, nodes)
    if why is None:
        return
    if embedded:
        raise UnavailableError(f"{why} (the embedded one-node Ray cluster cannot grow)")
    log.warning("%s; waiting for Ray to place them (nodes may still join)", why)


def wait_placed(poll: Callable[[float], bool], *, timeout_s: float | None, what: Callable[[], str],
                period_s: float = PLACEMENT_LOG_PERIOD_S, clock: Callable[[], float] = time.monotonic) -> None:
    """Call poll(seconds) (True once placed; it blocks up to `seconds`, at most 1 s so that a stop
    is noticed) until it is True.

    timeout_s None: wait forever (the autoscaler may still add the nodes), logging what() every
    period_s; otherwise UnavailableError naming --placement-timeout once timeout_s have passed."""
    start = clock()
    next_log = start + period_s
    while True:
        now = clock()
        left = None if timeout_s is None else start + timeout_s - now
        if left is not None and left <= 0:
            raise UnavailableError(f"{what()}; gave up after --placement-timeout={timeout_s:g} s (raise it, or "
                                   "leave it unset to wait for nodes as long as it takes)")
        if poll(1.0 if left is None else min(1.0, left)):
            return
        if clock() >= next_log:
            next_log += period_s
            log.warning("%s; waiting %.0f s so far%s", what(), clock() - start,
                        "" if timeout_s is None else f" of --placement-timeout={timeout_s:g} s")


class RayRanks:
    """The ranks of one replica as WorkerActors in a placement group.

    placement_timeout_s: how long launch() waits for the placement group (None: forever);
    cancel: when set (the coordinator stops), that wait ends with UnavailableError."""

    def __init__(self, spec: WorkerSpec, *, role: str = "unified", name: str = "replica",
                 placement_timeout_s: float | None = None, cancel: threading.Event | None = None) -> None:
        self.spec = spec
        self.placement_timeout_s = placement_timeout_s
        self.cancel = cancel
        self.world = spec.parallel.tp
        self.role = role
        self.name = name
        self.driver_host = ray.util.get_node_ip_address()
        self.actors: list[Any] = []
        self.serving: list[Any] = []
        self.pg = None
        self._stopping = False

    def launch(self, address: str, auth) -> None:
        from meshserve.cluster.executors.actors import WorkerActor

        bundle = rank_bundle(self.role, device=self.spec.device, gpus_per_rank=self.spec.parallel.gpus_per_rank)
        # Named for `ray list placement-groups`; the suffix keeps names unique across coordinators.
        self.pg = placement_group([bundle] * self.world, strategy="STRICT_PACK",
                                  name=f"meshserve-{self.name}-{uuid.uuid4().hex[:8]}")
        pg_ready = self.pg.ready()
        try:
            wait_placed(lambda seconds: self._placed(pg_ready, seconds),
                        timeout_s=self.placement_timeout_s,
                        what=lambda: (f"{self.name}: no Ray node can host {self.world} rank(s) of {bundle} yet "
                                      f"(cluster has {ray.cluster_resources()}, free {ray.available_resources()})"))
        except BaseException:
            remove_placement_group(self.pg)
            self.pg = None
            raise
        spec = self.spec.to_msgpack()
        extra = {}
        if "MESHSERVE_LOG" in os.environ:  # nodes of an existing cluster do not have the driver's environment
            extra["runtime_env"] = {"env_vars": {"MESHSERVE_LOG": os.environ["MESHSERVE_LOG"]}}
        for rank in range(self.world):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            actor = WorkerActor.options(scheduling_strategy=strategy, resources=_non_cpu(bundle),
                                        num_gpus=bundle.get("GPU", 0), **extra).remote(spec, rank)
            self.actors.append(actor)
        start = auth.to_msgpack()  # in the call's arguments (Ray's token-authenticated channel), not its env
        self.serving = [actor.serve.remote(address, start) for actor in self.actors]
        log.info("%s: %d actor(s) placed with %s", self.name, self.world, bundle)

    def _placed(self, pg_ready, seconds: float) -> bool:
        if self._stopping or (self.cancel is not None and self.cancel.is_set()):
            raise UnavailableError(f"{self.name}: stopped while waiting for Ray to place its ranks")
        return bool(ray.wait([pg_ready], timeout=seconds)[0])

    def check(self) -> None:
        if not self.serving or self._stopping:
            return
        ready, _ = ray.wait(self.serving, num_returns=len(self.serving), timeout=0)
        for ref in ready:
            rank = self.serving.index(ref)
            try:
                ray.get(ref)
                cause = "its channel loop ended"
            except ray.exceptions.RayActorError as exc:
                cause = actor_death_cause(exc)
            except Exception as exc:  # the loop itself raised
                cause = f"{type(exc).__name__}: {exc}"
            raise WorkerDiedError(f"rank {rank} actor of {self.name} died: {cause}")

    def nodes(self) -> list[dict[str, Any]]:
        """Per rank: node id, IP and pid of its actor."""
        return ray.get([a.node.remote() for a in self.actors])

    def health(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        self.check()
        refs = [a.check_health.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise WorkerDiedError(f"{self.name}: {len(refs) - len(ready)} rank(s) did not answer a health "
                                  f"check within {timeout_s} s")
        return ray.get(refs)

    def stop(self, *, now: bool = False) -> None:
        self._stopping = True
        if self.serving and not now:  # the channel said stop; give the loops a moment to end cleanly
            ray.wait(self.serving, num_returns=len(self.serving), timeout=5.0)
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.serving = [], []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def _non_cpu(bundle: dict[str, float]) -> dict[str, float]:
    """The actor takes the bundle's custom resources (its CPU / GPU go through num_cpus/num_gpus)."""
    return {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}


def actor_death_cause(exc: BaseException) -> str:
    """The informative part of Ray's actor-death message, on one line."""
    text = str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("The actor is dead because"):
            return line[:300]
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


class RayExecutor(ChannelExecutor):
    """An executor for `config` (an EngineConfig) whose tp ranks are Ray actors."""

    def __init__(self, config, *, role: str = "unified", name: str = "replica", device: str | None = None,
                 worker_class: str | None = None, secret=None, placement_timeout_s: float | None = None,
                 cancel: threading.Event | None = None, deadline=None) -> None:
        spec = WorkerSpec(config.model, config.cache, config.attention, config.parallel, device,
                          **({"worker_class": worker_class} if worker_class else {}))
        ranks = RayRanks(spec, role=role, name=name, placement_timeout_s=placement_timeout_s, cancel=cancel)
        super().__init__(ranks, name=name, secret=secret, deadline=deadline)

    def check_health(self) -> list[dict[str, Any]]:
        return self.ranks.health()
