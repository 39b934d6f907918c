"""What the wheel repacks (bench/repack_nixl.py, repack_flashinfer.py, repack_ray.py) share: unpack a
wheel keeping its files' modes, read ELF dependencies, strip shared objects and executables, and
write the pruned tree back as a wheel whose RECORD matches what it holds.

A device call carries at most 64 MiB (tree and carried folders together), so the wheels that
travel to it are cut down to what meshserve loads. pip installs a wheel whatever the compression
method of its members, as long as Python's zipfile reads it: LZMA (method 14) makes the large
shared objects about a third smaller than DEFLATE does.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping

ELF_MAGIC = b"\x7fELF"


def digest(data: bytes) -> str:
    """RECORD's hash of a file: sha256, urlsafe base64 without padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def unpack(wheel: str, root: str) -> None:
    """Extract `wheel` into `root`, keeping each member's permission bits (zipfile's extractall
    drops them; Ray's gcs_server and raylet must stay executable)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, root)
            mode = info.external_attr >> 16
            if mode and stat.S_ISREG(mode):
                os.chmod(path, stat.S_IMODE(mode))


def tree(root: str) -> dict[str, str]:
    """Every file under root: archive name (forward slashes) -> its path on disk."""
    return {os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"): os.path.join(d, f)
            for d, _, fs in os.walk(root) for f in fs}


def remove(root: str, rel: str) -> None:
    """Delete a file or folder under root (rel: a relative path)."""
    full = os.path.join(root, rel)
    shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == ELF_MAGIC


def needed(path: str) -> list[str]:
    """The DT_NEEDED sonames of an ELF file (readelf -d, binutils)."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def strip(paths: Iterable[str]) -> None:
    """Drop the symbols not needed for linking (`strip --strip-unneeded`, binutils) in place.
    Raises RuntimeError when strip is not installed (the repack scripts offer --no-strip)."""
    paths = list(paths)
    if not paths:
        return
    if shutil.which("strip") is None:
        raise RuntimeError("`strip` (binutils) is not installed: pass --no-strip")
    subprocess.run(["strip", "--strip-unneeded", *paths], check=True)


def wheel_name(original: str, *, build_tag: str | None = None) -> str:
    """The file name of a repack of `original` (a wheel's file name or path): the same, or with
    `build_tag` in place of the original's build tag, if any (pip prefers a higher build tag of
    the same version, and the name shows that the wheel is not the stock one)."""
    if build_tag is None:
        return os.path.basename(original)
    name, version, *tags = os.path.basename(original)[: -len(".whl")].split("-")
    return "-".join([name, version, build_tag, *tags[-3:]]) + ".whl"


def write_wheel(files: Mapping[str, bytes | str], path: str, *, compression: int = zipfile.ZIP_LZMA,
                compresslevel: int | None = None) -> str:
    """Write `files` (archive name -> contents, or -> a file on disk, whose permission bits are kept)
    as the wheel `path`, with a RECORD written for exactly these files (any RECORD among them is
    replaced) and the .dist-info folder last, as wheel builders order it. Returns path."""
    (dist_info,) = {name.split("/")[0] for name in files if name.split("/")[0].endswith(".dist-info")}
    record = f"{dist_info}/RECORD"
    names = sorted((n for n in files if n != record), key=lambda n: (n.startswith(dist_info + "/"), n))
    lines = []
    for name in names:
        data = _contents(files[name])
        lines.append(f"{name},sha256={digest(data)},{len(data)}")
    lines.append(f"{record},,")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=compression, compresslevel=compresslevel) as z:
        for name in names:
            source = files[name]
            if isinstance(source, bytes):
                z.writestr(name, source)
            else:
                z.write(source, name)
        z.writestr(record, "\n".join(lines) + "\n")
    return path


def _contents(source: bytes | str) -> bytes:
    if isinstance(source, bytes):
        return source
    with open(source, "rb") as f:
        return f.read()


def install_target(wheel: str, site: str, *, python: str = sys.executable) -> None:
    """pip install `wheel` alone (no dependencies, no index) into a fresh folder `site`."""
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", site, wheel], check=True)


def requires_dist(wheel: str) -> list[str]:
    """The wheel's Requires-Dist entries that no extra asks for, markers kept (pip evaluates them)."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    entries = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [e for e in entries if not re.search(r"\bextra\s*==", e.partition(";")[2])]
