"""bench/wheel_repack.py writes wheels that pip installs as they were meant: RECORD matches every
file (checked through importlib.metadata's reading of the installed RECORD, hashed again here),
LZMA members read back, an executable stays executable, extras' requirements are left out."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest

from bench import wheel_repack

METADATA = """Metadata-Version: 2.1
Name: tinypkg
Version: 1.0
Requires-Dist: msgpack<2,>=1
Requires-Dist: numpy; extra == "fast"
Requires-Dist: colorama; sys_platform == "win32"
Provides-Extra: fast
"""
WHEEL = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n"


@pytest.fixture
def original(tmp_path):
    """A wheel with a stale RECORD and an executable member, as Ray's gcs_server is."""
    path = tmp_path / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tinypkg/__init__.py", "VALUE = 7\n")
        tool = zipfile.ZipInfo("tinypkg/bin/tool")
        tool.external_attr = (stat.S_IFREG | 0o755) << 16
        z.writestr(tool, "#!/bin/sh\necho tool\n")
        z.writestr("tinypkg/big.txt", "x" * 100_000)
        z.writestr("tinypkg-1.0.dist-info/METADATA", METADATA)
        z.writestr("tinypkg-1.0.dist-info/WHEEL", WHEEL)
        z.writestr("tinypkg-1.0.dist-info/RECORD", "tinypkg/gone.py,sha256=stale,1\n")
    return str(path)


def test_a_repacked_wheel_installs_with_a_true_record_and_its_modes(original, tmp_path):
    root = tmp_path / "root"
    wheel_repack.unpack(original, str(root))
    assert os.stat(root / "tinypkg/bin/tool").st_mode & 0o111  # unpack keeps the executable bit
    wheel_repack.remove(str(root), "tinypkg/big.txt")
    files = wheel_repack.tree(str(root))
    assert set(files) == {"tinypkg/__init__.py", "tinypkg/bin/tool", "tinypkg-1.0.dist-info/METADATA",
                          "tinypkg-1.0.dist-info/WHEEL", "tinypkg-1.0.dist-info/RECORD"}
    files["tinypkg/extra.py"] = b"EXTRA = 1\n"  # contents given as bytes, beside files on disk
    name = wheel_repack.wheel_name(original, build_tag="1slim")
    assert name == "tinypkg-1.0-1slim-py3-none-any.whl"
    path = wheel_repack.write_wheel(files, str(tmp_path / "out" / name))

    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        assert {i.compress_type for i in infos} == {zipfile.ZIP_LZMA}
        assert infos[-1].filename == "tinypkg-1.0.dist-info/RECORD"  # dist-info last, RECORD last of all
        assert "gone.py" not in z.read("tinypkg-1.0.dist-info/RECORD").decode()

    site = tmp_path / "site"
    wheel_repack.install_target(path, str(site))
    assert os.stat(site / "tinypkg/bin/tool").st_mode & 0o111  # pip honours the mode written
    dist = importlib.metadata.Distribution.at(site / "tinypkg-1.0.dist-info")
    recorded = {str(f): f for f in dist.files}
    for name in ("tinypkg/__init__.py", "tinypkg/bin/tool", "tinypkg/extra.py"):
        data = (site / name).read_bytes()
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert recorded[name].hash.value == expected and recorded[name].size == len(data), name
    out = subprocess.run([sys.executable, "-c", "import tinypkg, tinypkg.extra; print(tinypkg.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


def test_requires_dist_leaves_extras_out_and_keeps_markers(original):
    assert wheel_repack.requires_dist(original) == ["msgpack<2,>=1", 'colorama; sys_platform == "win32"']


def test_strip_keeps_a_shared_object_loadable(tmp_path):
    """strip --strip-unneeded on a copy of a real extension module: smaller or equal, still imports."""
    import _ctypes

    if not _ctypes.__file__.endswith(".so") or shutil.which("strip") is None:
        pytest.skip("this Python's _ctypes is built in, or binutils is not installed")
    copy = tmp_path / os.path.basename(_ctypes.__file__)
    copy.write_bytes(open(_ctypes.__file__, "rb").read())
    assert wheel_repack.is_elf(str(copy)) and "libc.so.6" in wheel_repack.needed(str(copy))
    wheel_repack.strip([str(copy)])
    assert 0 < copy.stat().st_size <= os.path.getsize(_ctypes.__file__)
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import _ctypes; print(_ctypes.__file__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(copy)
