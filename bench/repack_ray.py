"""Repack the Ray wheel down to Ray Core, what meshserve's cluster layer runs on (the GCS, the
raylet with its object store, workers, actors, placement groups, runtime_env env_vars, token
authentication, the `ray` command), so that it travels beside the tree in a device call (64 MiB in
all; the stock ray 2.60.0 wheel is 79 MB). The GPU machine has no Ray and no network.

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 ray==2.60.0 -d /tmp/raydl
    python3 bench/repack_ray.py /tmp/raydl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl --out .whlray \\
        --system-aiohttp
    # 23.0 MB (24.0 MB without --system-aiohttp); the calls that need Ray carry .whlray beside .whl
    # (bench/device_setup.sh installs both); .whlray/ is ignored: never commit the wheel

What goes:
- ray/jars (the Java workers' jars, 32 MB compressed) and the Cython headers (ray/includes, *.pxd);
- the AI libraries: rllib, data, serve, train, tune, llm, air, workflow, and the util shims for
  dask, joblib, horovod, lightgbm, xgboost, sgd; the `serve` and `tune` console scripts;
- the dashboard's web client (ray/dashboard/client) and its data/serve/train modules, which
  import the libraries dropped. The dashboard's Python stays: the raylet starts the dashboard
  agent on every node, include_dashboard=False or not;
- with --system-aiohttp, the aiohttp (and its requirements) that Ray vendors for the runtime-env
  agent, which every raylet starts: 0.9 MB. The agent then imports the interpreter's aiohttp,
  which the GPU machine's image has (the device README's package list).
What stays is stripped: every ELF file (gcs_server, raylet, _raylet.so, libjemalloc, which Ray
preloads into its servers, and the vendored extension modules) loses the symbols not needed for
linking (`strip --strip-unneeded`, binutils: the four Ray binaries go from 121 to 85 MB), and
every member is LZMA-compressed (pip reads any method Python's zipfile does): the binaries are
20.9 MB of the result. RECORD is rewritten (bench/wheel_repack.py), the file name gains the build
tag `1core`. The repack is generic in the Python tag: the cp311 and cp312 wheels hold the same
files but for the extension modules' names.

Ray's own requirements (its METADATA's Requires-Dist without extras; `--deps` prints them) are
not in the wheel: click, filelock, jsonschema, msgpack, packaging, protobuf, pyyaml, requests.
The device image has all of them but jsonschema, which .whl carries (with referencing, rpds_py,
jsonschema_specifications, attrs).

Check it on the CPU machine with the cp311 build (the shared venv is Python 3.11 and has the stock
Ray installed, which must not be what the check imports):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \\
        --platform manylinux2014_x86_64 ray==2.60.0 -d /tmp/raydl311
    python3 bench/repack_ray.py /tmp/raydl311/ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl --out /tmp/rayslim \\
        --system-aiohttp --check

--check makes a venv of its own (OUT/venv, from the base interpreter, without the system's or the
shared venv's packages; kept for the next check) holding only Ray's requirements, grpcio, and
aiohttp where the repack left Ray's out; installs the repacked wheel into OUT/site (pip --target),
and in that venv's interpreter starts ray.init(num_cpus=2, include_dashboard=False), places a
STRICT_PACK placement group of two bundles, runs an actor in each (with a runtime_env env var, as
meshserve passes MESHSERVE_LOG), moves an 8 MiB object through the object store, asks the GCS for
its cluster id over gRPC with Ray's token interceptor (meshserve's probe_cluster; without it the
GCS answers UNAUTHENTICATED), and shuts down. meshserve's own Ray tests run on the repack too:
PYTHONPATH=$PWD:/tmp/rayslim/site ahead of the shared venv's Ray, e.g. tests/integration/
test_cluster_ray.py::test_disaggregated_pools_on_ray_hand_kv_over, test_gpu_share_ray.py.
"""

from __future__ import annotations

import argparse
import configparser
import io
import os
import subprocess
import sys
import tempfile
import zipfile

try:  # `python3 bench/repack_ray.py` puts bench/ on the path, `python3 -m bench.repack_ray` the repository
    import wheel_repack
except ModuleNotFoundError:
    from bench import wheel_repack

BUILD_TAG = "1core"
# Relative to the wheel's root; folders go whole.
DROP = (
    "ray/jars", "ray/includes", "ray/setup-dev.py",
    "ray/rllib", "ray/data", "ray/serve", "ray/train", "ray/tune", "ray/llm", "ray/air", "ray/workflow",
    "ray/util/dask", "ray/util/joblib", "ray/util/horovod", "ray/util/lightgbm", "ray/util/xgboost", "ray/util/sgd",
    "ray/dashboard/client", "ray/dashboard/modules/data", "ray/dashboard/modules/serve",
    "ray/dashboard/modules/train",
)  # fmt: skip
# The runtime-env agent (started by every raylet) puts this folder first on its path: aiohttp and its
# requirements, 0.9 MB of the repack. --system-aiohttp drops it for an interpreter that has aiohttp.
VENDORED_AIOHTTP = "ray/_private/runtime_env/agent/thirdparty_files"
DROP_SUFFIXES = (".pxd",)  # Cython headers: for building against Ray, not for running it
KEEP_SCRIPTS = {"ray"}  # console scripts; `serve` and `tune` would name dropped modules


def prune(root: str, *, system_aiohttp: bool = False) -> list[str]:
    """Delete DROP (and VENDORED_AIOHTTP when `system_aiohttp`) from an unpacked Ray wheel at
    `root` and keep only the `ray` console script; returns the paths deleted (relative to root)."""
    deleted = []
    for rel in DROP + ((VENDORED_AIOHTTP,) if system_aiohttp else ()):
        if os.path.exists(os.path.join(root, rel)):
            wheel_repack.remove(root, rel)
            deleted.append(rel)
    for name, path in wheel_repack.tree(root).items():
        if name.endswith(DROP_SUFFIXES):
            os.remove(path)
            deleted.append(name)
    (dist_info,) = [d for d in os.listdir(root) if d.endswith(".dist-info")]
    _keep_scripts(os.path.join(root, dist_info, "entry_points.txt"))
    return deleted


def _keep_scripts(entry_points: str) -> None:
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # names are case-sensitive
    parser.read(entry_points)
    for name in list(parser["console_scripts"]):
        if name not in KEEP_SCRIPTS:
            del parser["console_scripts"][name]
    text = io.StringIO()
    parser.write(text)
    with open(entry_points, "w") as f:
        f.write(text.getvalue().rstrip() + "\n")


def repack(wheel: str, out_dir: str, *, strip: bool = True, system_aiohttp: bool = False,
           compression: int = zipfile.ZIP_LZMA) -> tuple[str, int]:
    """Write the Ray Core repack of `wheel` into out_dir; returns (its path, paths dropped)."""
    with tempfile.TemporaryDirectory() as root:
        wheel_repack.unpack(wheel, root)
        deleted = prune(root, system_aiohttp=system_aiohttp)
        files = wheel_repack.tree(root)
        if strip:
            wheel_repack.strip(path for path in files.values() if wheel_repack.is_elf(path))
        path = os.path.join(out_dir, wheel_repack.wheel_name(wheel, build_tag=BUILD_TAG))
        wheel_repack.write_wheel(files, path, compression=compression)
    return path, len(deleted)


_CHECK = r"""
import os, sys, tempfile, time
site, temp_dir = sys.argv[1], sys.argv[2]
import ray
assert ray.__file__.startswith(site), f"imported {ray.__file__}, not the repacked Ray under {site}"
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

t0 = time.monotonic()
ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, logging_level="WARNING")
t_init = time.monotonic() - t0

@ray.remote
class Rank:
    def __init__(self, rank):
        self.rank = rank
    def where(self, blob):
        return {"rank": self.rank, "pid": os.getpid(), "env": os.environ.get("MESHSERVE_CHECK"),
                "node": ray.get_runtime_context().get_node_id(), "blob": len(ray.get(blob[0]))}

pg = placement_group([{"CPU": 0.01}] * 2, strategy="STRICT_PACK", name="repack-check")
ray.get(pg.ready(), timeout=60)
blob = ray.put(os.urandom(8 << 20))  # 8 MiB: through the plasma object store
actors = [Rank.options(num_cpus=0.01, runtime_env={"env_vars": {"MESHSERVE_CHECK": "on"}},
                       scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                       ).remote(i) for i in range(2)]
got = ray.get([a.where.remote([blob]) for a in actors], timeout=120)
assert [g["rank"] for g in got] == [0, 1] and len({g["pid"] for g in got}) == 2, got
assert all(g["env"] == "on" and g["blob"] == 8 << 20 for g in got), got
assert len({g["node"] for g in got}) == 1, got  # STRICT_PACK: one node

import grpc  # meshserve's probe_cluster: the GCS over gRPC with Ray's token interceptor
from ray._private.authentication.grpc_authentication_client_interceptor import (
    SyncAuthenticationMetadataClientInterceptor)
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
gcs = ray._private.worker.global_worker.node.gcs_address
def cluster_id(*interceptors):
    channel = grpc.intercept_channel(grpc.insecure_channel(gcs), *interceptors)
    try:
        return gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=10).cluster_id.hex()[:12]
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        channel.close()
with_token, without = cluster_id(SyncAuthenticationMetadataClientInterceptor()), cluster_id()
assert with_token not in ("UNAUTHENTICATED", "UNAVAILABLE", "DEADLINE_EXCEEDED"), with_token

for a in actors:
    ray.kill(a)
remove_placement_group(pg)
cpus = ray.cluster_resources()["CPU"]
t0 = time.monotonic()
ray.shutdown()
print(f"ray {ray.__version__} from {os.path.dirname(ray.__file__)}: init {t_init:.1f} s, "
      f"2 actors in a STRICT_PACK placement group on node {got[0]['node'][:8]} (pids {got[0]['pid']}, "
      f"{got[1]['pid']}), runtime_env env var and an 8 MiB object seen by both; GCS cluster id with the "
      f"token interceptor {with_token}, without it {without}; {cpus:g} CPUs; "
      f"shutdown {time.monotonic() - t0:.1f} s: ok")
"""


def check(wheel: str, out_dir: str) -> None:
    """Install `wheel` into out_dir/site and run Ray Core from it in a venv of its own (out_dir/venv:
    Ray's requirements and grpcio, nothing else, so the stock Ray of the shared venv is not seen)."""
    venv = os.path.join(out_dir, "venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        base = getattr(sys, "_base_executable", sys.executable)  # not a venv's python: its packages would show
        subprocess.run([base, "-m", "venv", venv], check=True)
    requirements = wheel_repack.requires_dist(wheel) + ["grpcio"]
    with zipfile.ZipFile(wheel) as z:
        if not any(name.startswith(VENDORED_AIOHTTP + "/") for name in z.namelist()):
            requirements.append("aiohttp")  # repacked with --system-aiohttp
    subprocess.run([python, "-m", "pip", "install", "-q", *requirements], check=True)
    site = os.path.join(out_dir, "site")
    wheel_repack.install_target(wheel, site, python=python)
    with tempfile.TemporaryDirectory(prefix="ray-check-") as temp_dir:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RAY_", "VIRTUAL_ENV"))}
        env |= {"PYTHONPATH": site, "PYTHONNOUSERSITE": "1"}
        subprocess.run([python, "-c", _CHECK, site, temp_dir], check=True, env=env, timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="a ray wheel, manylinux x86_64, any CPython tag")
    parser.add_argument("--out", default=".whlray", help="where the repacked wheel goes (default .whlray)")
    parser.add_argument("--no-strip", action="store_true", help="keep the ELF files' symbol tables")
    parser.add_argument("--system-aiohttp", action="store_true", help="leave out the runtime-env agent's vendored "
                        "aiohttp (0.9 MB): Ray then needs aiohttp installed, as the GPU machine's image has it")
    parser.add_argument("--deflate", action="store_true", help="DEFLATE instead of LZMA (larger)")
    parser.add_argument("--check", action="store_true", help="install into OUT/site and run Ray Core from it "
                        "in OUT/venv (Ray's requirements only)")
    parser.add_argument("--deps", action="store_true", help="print the wheel's requirements without extras")
    args = parser.parse_args()
    if args.deps:
        print("\n".join(wheel_repack.requires_dist(args.wheel)))
    try:
        path, dropped = repack(args.wheel, args.out, strip=not args.no_strip, system_aiohttp=args.system_aiohttp,
                               compression=zipfile.ZIP_DEFLATED if args.deflate else zipfile.ZIP_LZMA)
    except RuntimeError as exc:  # strip missing
        parser.error(str(exc))
    before, after = os.path.getsize(args.wheel), os.path.getsize(path)
    print(f"{path}: {after / 1e6:.1f} MB (from {before / 1e6:.1f} MB); {dropped} paths dropped")
    if args.check:
        check(path, args.out)


if __name__ == "__main__":
    main()
