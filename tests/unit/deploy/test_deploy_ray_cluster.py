"""deploy/ray/cluster.yaml, checked by Ray's own cluster-launcher code (offline: no SSH happens).

`prepare_config` and `validate_config` are what `ray up` runs on the file before it contacts a
host; then the commands it would run are taken apart and compared with the server contract.
"""

from __future__ import annotations

import json
import shlex
import subprocess

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
    ray_cmd, supervised = (shlex.split(c) for c in config["head_start_ray_commands"][1:])
    assert ray_cmd[:3] == ["ray", "start", "--head"] and {"--num-gpus=0", "--port=6379"} <= set(ray_cmd)
    # A shell loop supervises the server: started again whenever it exits.
    assert supervised[:3] == ["nohup", "sh", "-c"] and supervised[-1] == "&" and ">>" in supervised
    assert subprocess.run(["sh", "-n", "-c", supervised[3]], capture_output=True).returncode == 0  # parses
    loop = shlex.split(supervised[3])
    assert loop[:3] == ["while", "true;", "do"] and loop[-2:] == ["5;", "done"] and "sleep" in loop
    serve_cmd = loop[3:loop.index("echo")]
    assert serve_cmd[:2] == ["meshserve", "serve"] and serve_cmd[-1].endswith(";")
    args = serve_cmd[2:-1] + [serve_cmd[-1].rstrip(";")]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--host"] == flags["--grpc-host"] == "0.0.0.0" and flags["--ray-address"] == "auto"
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
    docker = config["docker"]
    options = docker["run_options"]
    # The image's ENTRYPOINT is meshserve; the launcher starts the container with `bash`.
    assert '--entrypoint=""' in options
    assert any(o.startswith("--shm-size=") for o in options)
    # GPUs only where they are: the head host has none, and `--gpus=all` fails there.
    assert not any(o.startswith("--gpus") for o in options + docker["head_run_options"])
    assert "--gpus=all" in docker["worker_run_options"]


def test_every_node_runs_ray_token_auth_with_the_launchers_token(config):
    assert "--env=RAY_AUTH_MODE=token" in config["docker"]["run_options"]
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}  # Ray's default token path
