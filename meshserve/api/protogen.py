"""Regenerate the checked-in gRPC stubs from meshserve/v1/inference.proto with grpcio-tools.

    python -m meshserve.api.protogen          # rewrites meshserve/v1/inference_pb2*.py(i)

The proto is compiled from the folder above the package with its package path, so the
generated `inference_pb2_grpc.py` imports `meshserve.v1.inference_pb2` (not a top-level
`inference_pb2`). A test regenerates into a temporary folder and compares byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding meshserve/
PROTO = "meshserve/v1/inference.proto"
GENERATED = ("meshserve/v1/inference_pb2.py", "meshserve/v1/inference_pb2.pyi", "meshserve/v1/inference_pb2_grpc.py")


def protoc(*args: str) -> None:
    """Run grpcio-tools' protoc in a process of its own: its bundled protobuf and abseil clash with
    NIXL's (nixl-cu13 1.5.1) when both load into one process (a segmentation fault either way round)."""
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PACKAGE_ROOT}", *args, PROTO],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed on {PROTO}: {done.stderr.strip()}")


def generate(out_root: Path) -> list[Path]:
    """Compile the proto into `out_root` (mirroring meshserve/v1/); returns the files written."""
    out_root.mkdir(parents=True, exist_ok=True)
    protoc(f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}")
    return [out_root / name for name in GENERATED]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = PACKAGE_ROOT / path.relative_to(tmp)
            target.write_bytes(path.read_bytes())
            print(f"wrote {target.relative_to(PACKAGE_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
