"""Repack a nixl-cu13 wheel down to what meshserve's KV data plane loads (the UCX backend), so that
it fits beside the tree in a device call (64 MiB in all; the stock wheel is 59 MB).

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 nixl-cu13==1.5.1 -d /tmp/nixlwhl
    python3 bench/repack_nixl.py /tmp/nixlwhl/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl --out .whl
    # the device call then installs .whl/*.whl (bench/device_setup.sh); never commit the wheel

What goes: the `nixl_ep_*` package (expert-parallel kernels, 28 MB compressed), the wheel's
scripts and headers, every NIXL plugin but UCX (GDS, POSIX, OBJ/S3, Azure, LIBFABRIC, GUSLI, ...)
and the telemetry/trace plugins, UCX's perftest modules, libtool archives, and every bundled
library that nothing kept needs (aws, azure, curl, xml2, s2n, ...: found by walking the ELF
DT_NEEDED entries, `readelf -d`, from the Python extensions, the UCX plugin and UCX's transport
modules, which UCX opens by itself: CMA and CUDA; InfiniBand/RoCE only with --rdma, for hosts with
RDMA NICs: without them UCX moves between hosts by TCP). The kept shared objects are stripped
of symbols not needed for linking (`strip --strip-unneeded`, binutils) and the members
compressed with LZMA (pip reads any method Python's zipfile does). RECORD is rewritten
(bench/wheel_repack.py); the file name gains the build tag `1slim`. The repack is generic in the
Python tag: the cp311 and cp312 wheels hold the same files but for the extension modules' names.

Check it on the CPU machine with the cp311 build (`--python-version 3.11`), installed into a
scratch directory: `python3 bench/repack_nixl.py WHEEL --out /tmp/slim --check` installs the
result into /tmp/slim/site (pip --target) and runs a two-agent DRAM READ from it in a fresh
interpreter.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile

try:  # `python3 bench/repack_nixl.py` puts bench/ on the path, `python3 -m bench.repack_nixl` the repository
    import wheel_repack
except ModuleNotFoundError:
    from bench import wheel_repack

_KEEP_PLUGINS = {"libplugin_UCX.so"}
_PLUGIN = re.compile(r"^lib(plugin|telemetry_exporter|trace_backend)_.*\.so$")
_UCX_MODULE = re.compile(r"^lib(uct|ucm)_[a-z0-9_]+\.so(\.\d+)*$")  # UCX opens these itself
_RDMA_MODULE = re.compile(r"^libuct_ib")  # InfiniBand/RoCE transports (and, through them, libibverbs, mlx5)
_SHARED = re.compile(r"\.so(\.|$)")  # libx.so, libx.so.1.2, libazure-core-….so.1.17.0-beta.1


def prune(root: str, *, rdma: bool) -> tuple[list[str], list[str]]:
    """Delete what the UCX data plane does not load from an unpacked wheel at `root` (UCX's
    InfiniBand transports too unless `rdma`); returns (kept shared objects, deleted paths),
    relative to root. NIXL loads its plugins from the `plugins` folder beside libnixl.so (found
    by dladdr): the second copy the wheel carries elsewhere goes."""
    deleted: list[str] = []

    def drop(rel: str) -> None:
        wheel_repack.remove(root, rel)
        deleted.append(rel)

    for top in sorted(os.listdir(root)):
        if top.startswith("nixl_ep") or top.endswith((".data", ".scripts")):
            drop(top)
    (libnixl,) = [os.path.relpath(os.path.join(d, "libnixl.so"), root) for d, _, fs in os.walk(root)
                  if "libnixl.so" in fs]
    plugin_dir = os.path.join(os.path.dirname(libnixl), "plugins")
    shared = []  # every shared object left, relative paths
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if name.endswith(".la") or name.startswith("libucx_perftest") or (not rdma and _RDMA_MODULE.match(name)):
                drop(rel)
            elif _PLUGIN.match(name) and (name not in _KEEP_PLUGINS or os.path.dirname(rel) != plugin_dir):
                drop(rel)
            elif _SHARED.search(name):
                shared.append(rel)
    package_dirs = {d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "__init__.py"))}
    roots = [rel for rel in shared
             if rel.split(os.sep)[0] in package_dirs  # the Python extensions
             or os.path.basename(rel) in _KEEP_PLUGINS or _UCX_MODULE.match(os.path.basename(rel))]
    by_name: dict[str, list[str]] = {}
    for rel in shared:
        by_name.setdefault(os.path.basename(rel), []).append(rel)
    keep, todo = set(), list(roots)
    while todo:
        rel = todo.pop()
        if rel in keep:
            continue
        keep.add(rel)
        for soname in wheel_repack.needed(os.path.join(root, rel)):
            todo += by_name.get(soname, [])  # absent: a system library (libc, libstdc++, CUDA's)
    for rel in shared:
        if rel not in keep:
            drop(rel)
    return sorted(keep), deleted


_CHECK = r"""
import os, sys, time
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
import torch
mod = __import__(sys.argv[1])
assert mod.__file__.startswith(sys.argv[2]), mod.__file__
cfg = lambda: mod.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
a, b = mod.nixl_agent("check-a", cfg()), mod.nixl_agent("check-b", cfg())
src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
dst = torch.zeros_like(src)
b.register_memory([(src.data_ptr(), src.numel(), 0, "")], "DRAM")
a.register_memory([(dst.data_ptr(), dst.numel(), 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
h = a.initialize_xfer("READ", a.get_xfer_descs([(dst.data_ptr(), dst.numel(), 0)], "DRAM"),
                      a.get_xfer_descs([(src.data_ptr(), src.numel(), 0)], "DRAM"), "check-b")
state, deadline = a.transfer(h), time.monotonic() + 30
while state == "PROC" and time.monotonic() < deadline:
    b.get_new_notifs()  # both agents in this process, no progress threads: progress the exporter too
    state = a.check_xfer_state(h)
assert state == "DONE" and torch.equal(src, dst), state
print("two-agent DRAM READ of 1 MiB from", os.path.dirname(mod.__file__), "ok; plugins:", a.get_plugin_list())
"""


def check(wheel: str, out_dir: str) -> None:
    """Install `wheel` into out_dir/site and READ between two agents from it (a fresh interpreter)."""
    site = os.path.join(out_dir, "site")
    wheel_repack.install_target(wheel, site)
    module = os.path.basename(wheel).split("-")[0]  # nixl_cu13
    env = {**os.environ, "PYTHONPATH": site}
    subprocess.run([sys.executable, "-c", _CHECK, module, site], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="a nixl-cu13 (or nixl-cu12) wheel, manylinux x86_64, any CPython tag")
    parser.add_argument("--out", default=".whl", help="where the repacked wheel goes (default .whl)")
    parser.add_argument("--rdma", action="store_true", help="keep UCX's InfiniBand/RoCE transports (GPU hosts "
                        "with RDMA NICs; about 0.7 MB more): without them UCX uses TCP, CMA and CUDA IPC")
    parser.add_argument("--no-strip", action="store_true", help="keep the shared objects' symbol tables")
    parser.add_argument("--deflate", action="store_true", help="DEFLATE instead of LZMA (larger)")
    parser.add_argument("--check", action="store_true", help="install into OUT/site and run a two-agent READ")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel_repack.unpack(args.wheel, tmp)
        kept, deleted = prune(tmp, rdma=args.rdma)
        try:
            if not args.no_strip:
                wheel_repack.strip(os.path.join(tmp, rel) for rel in kept)
        except RuntimeError as exc:  # strip missing
            parser.error(str(exc))
        path = wheel_repack.write_wheel(
            wheel_repack.tree(tmp), os.path.join(args.out, wheel_repack.wheel_name(args.wheel, build_tag="1slim")),
            compression=zipfile.ZIP_DEFLATED if args.deflate else zipfile.ZIP_LZMA)
    before, after = os.path.getsize(args.wheel), os.path.getsize(path)
    print(f"{path}: {after / 1e6:.1f} MB (from {before / 1e6:.1f} MB); {len(kept)} shared objects kept, "
          f"{len(deleted)} paths dropped")
    if args.check:
        check(path, args.out)


if __name__ == "__main__":
    main()
