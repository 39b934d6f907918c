"""meshserve's compiled CPU ops: one C++ module, built on first use, holding every CPU kernel.

Two sources go into it, beside this file: the paged decode kernel of CPU_SDPA
(cpu_paged_decode.cpp; cpu_paged_decode.py) and the decoder layer's small fused ops
(cpu_step_ops.cpp; cpu_step_ops.py: residual add + RMSNorm, SiLU * up, rotary embedding + K/V
write, greedy's argmax). One module, not one per source, because the compile is mostly
torch's headers (about 20-45 s on 2 cores each time): a second module would double the first
start. It lives here, beside the backend that first asks for it, because the attention layer is
the lowest one that both the backend and the model (workers/, which may import attention/) reach.

Build: `torch.utils.cpp_extension.load_inline` when the first float32 CPU_SDPA backend is made
(engine start, not a request's first decode), into a cache directory outside the source tree
(`$MESHSERVE_EXT_DIR`, else ~/.cache/meshserve/ext), named by a hash of the sources, the
compiler flags, torch's version and the CPU (model name and flags), so the compile happens once
per machine image; later processes load the built module. Any failure (no compiler, no ninja, a
compile error, a lock held too long) logs one warning and `cpu_extension()` returns None: the
torch ops serve. `MESHSERVE_CPU_KERNELS=0` turns every compiled op off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("meshserve.attention")

_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast"]
FUNCTIONS = ["paged_decode", "add_rms_norm", "silu_and_mul", "rotary_write_kv", "argmax_rows"]


SOURCES = ("cpu_paged_decode.cpp", "cpu_step_ops.cpp")  # in this order: the second uses the first's helpers


def _sources() -> list[str]:
    here = Path(__file__).parent
    return [(here / name).read_text() for name in SOURCES]


def cache_dir() -> Path:
    """Where the built module lives: $MESHSERVE_EXT_DIR, else ~/.cache/meshserve/ext (never the
    source tree). The name carries a hash of the sources, the flags, torch's version and the CPU
    model, so a changed kernel, torch or machine builds anew instead of loading a stale module."""
    root = os.environ.get("MESHSERVE_EXT_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "meshserve", "ext")
    return Path(root)


def _cpu_model() -> str:
    """The first core's model name and feature flags: -march=native code built on one CPU may not
    run on another of the same name (a module built with AVX-512 dies on SIGILL without it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    model = next((x for x in lines if x.startswith("model name")), "")
    flags = next((x for x in lines if x.startswith("flags")), "")
    return model + "\n" + flags


def build_name() -> str:
    key = "\n".join([*_sources(), " ".join(_FLAGS), " ".join(FUNCTIONS), torch.__version__, _cpu_model()])
    return "meshserve_cpu_ops_" + hashlib.sha256(key.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def cpu_extension() -> ModuleType | None:
    """The compiled module (its functions: FUNCTIONS), built on the first call of the process or
    loaded from the cache directory; None when it is turned off or cannot be built (one
    warning, with the reason)."""
    if os.environ.get("MESHSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        name = build_name()
        build = cache_dir() / name
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            log.info("building meshserve's CPU kernels into %s (once per machine; 30-60 s on 2 cores)", build)
        return load_inline(name=name, cpp_sources=_sources(), functions=FUNCTIONS, extra_cflags=_FLAGS,
                           build_directory=str(build), verbose=False)
    except Exception as exc:  # any build or load failure: the torch ops serve, said once
        log.warning("CPU kernels unavailable (%s: %s); the torch ops serve (CPU_SDPA's torch path, unfused layers)",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


__all__ = ["cpu_extension", "cache_dir", "build_name", "FUNCTIONS"]
