"""deploy/ray/cluster.yaml, checked by Ray's own cluster-launcher code (offline: no SSH happens).

`prepare_config` and `validate_config` are what `ray up` runs on the file before it contacts a
host; then the commands it would run are taken apart and compared with the server contract.
"""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.unit.deploy.manifests import REPO

CLUSTER = REPO / "deploy" / "ray" / "cluster.yaml"


@pytest.fixture(scope="module")
def config():
    return yaml.safe_load(CLUSTER.read_text())


def test_ray_up_accepts_the_file(config):
    prepared = prepare_config(config)
    validate_config(prepared)
    (node_type,) = prepared["available_node_types"].values()
    # Every listed GPU host stays in the cluster.
    assert node_type["min_workers"] == node_type["max_workers"] == len(config["provider"]["worker_ips"])


def test_head_starts_ray_without_gpus_then_the_server(config):
    ray_cmd, serve_cmd = (shlex.split(c) for c in config["head_start_ray_commands"][1:])
    assert ray_cmd[:3] == ["ray", "start", "--head"] and {"--num-gpus=0", "--port=6379"} <= set(ray_cmd)
    assert serve_cmd[:3] == ["nohup", "meshserve", "serve"] and serve_cmd[-1] == "&"
    args = serve_cmd[3:serve_cmd.index(">")]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--host"] == "0.0.0.0" and flags["--ray-address"] == "auto"
    assert int(flags["--tp"]) % int(flags["--dcp"]) == 0 and flags["--pools"] == "unified"
    assert flags["--model"].startswith("/models/")
    options = config["docker"]["run_options"]
    assert any(o.startswith("--volume=") and o.endswith(":/models:ro") for o in options)


def test_workers_join_the_head_with_their_pool_resource(config):
    (cmd,) = (shlex.split(c) for c in config["worker_start_ray_commands"][1:])
    assert cmd[:3] == ["ray", "start", "--address=$RAY_HEAD_IP:6379"]
    resources = json.loads(next(a for a in cmd if a.startswith("--resources=")).removeprefix("--resources="))
    assert resources == {"meshserve_unified": 8}


def test_container_gets_a_shell_gpus_and_shared_memory(config):
    options = config["docker"]["run_options"]
    # The image's ENTRYPOINT is meshserve; the launcher starts the container with `bash`.
    assert '--entrypoint=""' in options and "--gpus=all" in options
    assert any(o.startswith("--shm-size=") for o in options)
