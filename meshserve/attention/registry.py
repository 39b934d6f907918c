"""Backend registry: names map to lazy imports; selection walks a per-platform priority list.

Automatic selection takes the first backend in the platform's priority list that validates.
Explicit selection validates the named backend and fails with its reasons. When nothing is
valid the error lists every backend with every reason. An ImportError is a reason too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from meshserve.attention.backend import AttentionBackend, AttentionProblem
from meshserve.errors import ConfigError, NoBackendError

# name -> "module:Class"; imported only when asked for.
BACKENDS: dict[str, str] = {
    "TORCH": "meshserve.attention.backends.torch_ref:TorchBackend",
    "TRITON": "meshserve.attention.backends.triton_paged:TritonBackend",
    "FLASHINFER": "meshserve.attention.backends.flashinfer:FlashInferBackend",
}

# Priority per platform (first valid wins). See docs/attention-backends.md for the measurements.
PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda_sm90": ("FLASHINFER", "TRITON", "TORCH"),
    "cuda_sm100": ("FLASHINFER", "TRITON", "TORCH"),
    "cuda": ("TRITON", "TORCH"),
    "cpu": ("TORCH", "TRITON"),
}


def platform_of(problem: AttentionProblem) -> str:
    """The priority list that applies to `problem`'s device."""
    if problem.device != "cuda":
        return "cpu"
    cc = problem.compute_capability or (0, 0)
    if cc >= (10, 0):
        return "cuda_sm100"
    if cc >= (9, 0):
        return "cuda_sm90"
    return "cuda"


def load_backend(name: str) -> type[AttentionBackend]:
    """Import and return the backend class registered as `name` (ImportError propagates)."""
    if name not in BACKENDS:
        raise ConfigError("attention_backend", name, f"one of {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class Verdict:
    """One backend's answer for a problem: empty reasons means it can serve it."""

    name: str
    reasons: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.reasons


def judge(name: str, problem: AttentionProblem) -> Verdict:
    try:
        backend = load_backend(name)
    except ImportError as exc:
        return Verdict(name, (f"cannot be imported: {exc}",))
    return Verdict(name, tuple(backend.validate_configuration(problem)))


def explain(problem: AttentionProblem) -> list[Verdict]:
    """Every registered backend's verdict, in the platform's priority order first."""
    order = list(PRIORITIES[platform_of(problem)])
    order += [n for n in BACKENDS if n not in order]
    return [judge(n, problem) for n in order]


def _format(verdicts: list[Verdict]) -> str:
    return "\n".join(f"  {v.name}: " + "; ".join(v.reasons) for v in verdicts)


def select_backend(problem: AttentionProblem, name: str | None = None) -> type[AttentionBackend]:
    """The backend class to use: `name` if given (validated), else the first valid by priority."""
    if name is not None:
        name = name.upper()
        if name not in BACKENDS:
            raise ConfigError("attention_backend", name, f"one of {sorted(BACKENDS)}")
        verdict = judge(name, problem)
        if not verdict.ok:
            raise NoBackendError(
                f"attention backend {name} cannot serve this configuration:\n" + _format([verdict])
            )
        return load_backend(name)
    verdicts = explain(problem)
    for verdict in verdicts:
        if verdict.ok and verdict.name in PRIORITIES[platform_of(problem)]:
            return load_backend(verdict.name)
    raise NoBackendError("no attention backend can serve this configuration:\n" + _format(verdicts))
