"""Backend registry: names map to lazy imports; selection walks a per-platform priority list.

Automatic selection takes the first backend that validates, in the order `default_order` gives:
on CUDA the measured order of kernel_choice.json for the problem's class (kernel_choice.py),
where the table has that class; otherwise the platform's fixed priority list.
Explicit selection validates the named backend and fails with its reasons. When nothing is
valid the error lists every backend with every reason. An ImportError is a reason too.

Four tables, one selection logic (`kind`): standard attention, multi-head latent attention
whose decode and prefill backends are chosen separately (as vLLM does): decode attends in the
latent space, prefill over expanded K/V, and the fastest of each differs; and sparse MLA
(DeepSeek-V3.2's indexer top-k), one backend for both phases.

Standard layers may split their phases too: a name spelled `prefill=FLASHINFER,decode=TRITON`
(or a kernel-choice split, kernel_choice.py) gives a class made by
attention/backends/phase_split.py that runs each phase on its backend over one cache.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from meshserve.attention.backend import AttentionBackend, AttentionProblem
from meshserve.attention.kernel_choice import Choice, choose
from meshserve.core.attention_options import canonical_attention_backend, parse_attention_backend, split_spelling
from meshserve.errors import ConfigError, NoBackendError, as_enum

if TYPE_CHECKING:
    from meshserve.attention.mla.backend import MLABackend

# name -> "module:Class"; imported only when asked for.
BACKENDS: dict[str, str] = {
    "TORCH": "meshserve.attention.backends.torch_ref:TorchBackend",
    "CPU_SDPA": "meshserve.attention.backends.cpu_sdpa:CpuSdpaBackend",
    "TRITON": "meshserve.attention.backends.triton_paged:TritonBackend",
    "FLASHINFER": "meshserve.attention.backends.flashinfer:FlashInferBackend",
}

# Priority per platform (first valid wins) where kernel_choice.json has no measurement for the
# problem's class. See docs/attention-backends.md for the measurements.
PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda_sm90": ("FLASHINFER", "TRITON", "TORCH"),
    "cuda_sm100": ("FLASHINFER", "TRITON", "TORCH"),
    "cuda": ("TRITON", "TORCH"),
    "cpu": ("CPU_SDPA", "TORCH", "TRITON"),
}


MLA_DECODE_BACKENDS: dict[str, str] = {
    "TORCH": "meshserve.attention.mla.backends.torch_ref:TorchMLABackend",
    "TRITON": "meshserve.attention.mla.backends.triton_decode:TritonMLADecodeBackend",
    "FLASHINFER": "meshserve.attention.mla.backends.flashinfer:FlashInferMLADecodeBackend",
}
MLA_DECODE_PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda_sm90": ("FLASHINFER", "TRITON", "TORCH"),
    "cuda_sm100": ("FLASHINFER", "TRITON", "TORCH"),
    "cuda": ("TRITON", "TORCH"),
    "cpu": ("TORCH", "TRITON"),
}
MLA_PREFILL_BACKENDS: dict[str, str] = {
    "TORCH": "meshserve.attention.mla.backends.torch_ref:TorchMLABackend",
    "TRITON": "meshserve.attention.mla.backends.triton_prefill:TritonMLAPrefillBackend",
}
MLA_PREFILL_PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda_sm90": ("TRITON", "TORCH"),
    "cuda_sm100": ("TRITON", "TORCH"),
    "cuda": ("TRITON", "TORCH"),
    "cpu": ("TORCH", "TRITON"),
}
# Sparse MLA (DeepSeek-V3.2): one backend for both phases; each query token attends to the rows
# its lightning indexer chose (attention/mla/sparse.py).
MLA_SPARSE_BACKENDS: dict[str, str] = {
    "TORCH": "meshserve.attention.mla.backends.torch_sparse:TorchSparseMLABackend",
    "TRITON": "meshserve.attention.mla.backends.triton_sparse:TritonSparseMLABackend",
}
MLA_SPARSE_PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda_sm90": ("TRITON", "TORCH"),
    "cuda_sm100": ("TRITON", "TORCH"),
    "cuda": ("TRITON", "TORCH"),
    "cpu": ("TORCH", "TRITON"),
}


class BackendKind(StrEnum):
    ATTENTION = "attention"  # standard layers: AttentionBackend
    MLA_DECODE = "mla_decode"  # MLA layers, decode sequences: MLABackend
    MLA_PREFILL = "mla_prefill"  # MLA layers, prefill sequences: MLABackend
    MLA_SPARSE = "mla_sparse"  # sparse MLA layers (indexer top-k), every token: SparseMLABackend


def tables(kind: BackendKind | str = BackendKind.ATTENTION) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """(name -> "module:Class", platform -> priority) of one kind, read when called."""
    kind = as_enum(BackendKind, "backend kind", kind)
    if kind is BackendKind.MLA_DECODE:
        return MLA_DECODE_BACKENDS, MLA_DECODE_PRIORITIES
    if kind is BackendKind.MLA_PREFILL:
        return MLA_PREFILL_BACKENDS, MLA_PREFILL_PRIORITIES
    if kind is BackendKind.MLA_SPARSE:
        return MLA_SPARSE_BACKENDS, MLA_SPARSE_PRIORITIES
    return BACKENDS, PRIORITIES


def _field(kind: BackendKind | str) -> str:
    """The setting that names a backend of this kind (for error messages): attention_backend, ..."""
    return f"{as_enum(BackendKind, 'backend kind', kind)}_backend"


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


def canonical_name(name: str, kind: BackendKind | str = BackendKind.ATTENTION) -> str:
    """`name` as the registry spells it: upper case, or for standard attention a phase split
    'prefill=A,decode=B' (a split of one name is that name); ConfigError names the setting and
    what is allowed."""
    backends, _ = tables(kind)
    if as_enum(BackendKind, "backend kind", kind) is not BackendKind.ATTENTION:
        if str(name).upper() not in backends:
            raise ConfigError(_field(kind), name, f"one of {sorted(backends)}")
        return str(name).upper()
    return canonical_attention_backend(name, _field(kind), names=tuple(backends))


def load_backend(
    name: str, kind: BackendKind | str = BackendKind.ATTENTION
) -> type[AttentionBackend] | type[MLABackend]:
    """Import and return the backend class registered as `name` (ImportError propagates); for
    standard attention a split 'prefill=A,decode=B' gives the phase-split class of A and B."""
    backends, _ = tables(kind)
    if name not in backends:
        parsed = parse_attention_backend(canonical_name(name, kind), _field(kind), names=tuple(backends))
        if isinstance(parsed, str):
            return load_backend(parsed, kind)
        from meshserve.attention.backends.phase_split import phase_split_backend

        return phase_split_backend(load_backend(parsed[0]), load_backend(parsed[1]))
    module, _, cls = backends[name].partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class Verdict:
    """One backend's answer for a problem: empty reasons means it can serve it."""

    name: str
    reasons: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.reasons


def judge(name: str, problem: AttentionProblem, kind: BackendKind | str = BackendKind.ATTENTION) -> Verdict:
    try:
        backend = load_backend(name, kind)
    except ImportError as exc:
        return Verdict(name, (f"cannot be imported: {exc}",))
    return Verdict(name, tuple(backend.validate_configuration(problem)))


def default_order(problem: AttentionProblem, kind: BackendKind | str = BackendKind.ATTENTION) -> Choice:
    """The order automatic selection tries backends in, and why: the measured order of the
    kernel-choice table where it has the problem's class (CUDA only), else the priority list."""
    kind = as_enum(BackendKind, "backend kind", kind)
    backends, priorities = tables(kind)
    choice = choose(problem, str(kind), priorities[platform_of(problem)])
    known = tuple(n for n in choice.order if n in backends)  # a table naming an unregistered backend: ignored
    split = choice.split if choice.split is not None and set(choice.split) <= set(backends) else None
    return replace(choice, order=known, split=split)


def explain(problem: AttentionProblem, kind: BackendKind | str = BackendKind.ATTENTION) -> list[Verdict]:
    """Every registered backend's verdict, in the default order first (a measured phase split
    first of all, under its spelling 'prefill=A,decode=B')."""
    backends, _ = tables(kind)
    choice = default_order(problem, kind)
    order = list(choice.order)
    order += [n for n in backends if n not in order]
    if choice.split is not None:
        order.insert(0, split_spelling(*choice.split))
    return [judge(n, problem, kind) for n in order]


def _candidates(choice: Choice) -> tuple[str, ...]:
    """Names automatic selection tries, in order: the measured split, then the ranked backends."""
    return ((split_spelling(*choice.split),) if choice.split is not None else ()) + choice.order


def _format(verdicts: list[Verdict]) -> str:
    return "\n".join(f"  {v.name}: " + "; ".join(v.reasons) for v in verdicts)


def select_backend(
    problem: AttentionProblem, name: str | None = None, *, kind: BackendKind | str = BackendKind.ATTENTION
) -> type[AttentionBackend] | type[MLABackend]:
    """The backend class to use: `name` if given (validated), else the first valid by priority.

    kind ATTENTION gives an AttentionBackend subclass; MLA_DECODE / MLA_PREFILL an MLABackend one.
    """
    backends, priorities = tables(kind)
    what = "attention backend" if str(kind) == "attention" else f"{kind} backend"
    if name is not None:
        name = canonical_name(name, kind)
        verdict = judge(name, problem, kind)
        if not verdict.ok:
            raise NoBackendError(f"{what} {name} cannot serve this configuration:\n" + _format([verdict]))
        return load_backend(name, kind)
    verdicts = explain(problem, kind)
    candidates = _candidates(default_order(problem, kind))
    for verdict in verdicts:
        if verdict.ok and verdict.name in candidates:
            return load_backend(verdict.name, kind)
    raise NoBackendError(f"no {what} can serve this configuration:\n" + _format(verdicts))


def select_backend_for_layers(
    problems: list[AttentionProblem], name: str | None = None
) -> type[AttentionBackend]:
    """One standard-attention backend class for every layer's problem (hybrid models mix
    windowed and full layers; GPT-OSS adds sinks): `name` if given and valid for all, else the
    first by priority that serves every layer. The error names each refused backend with the
    reasons per layer kind (e.g. FLASHINFER: "learned sink logits not supported")."""
    check_problems = list(dict.fromkeys(problems))
    if len(check_problems) == 1:
        return select_backend(check_problems[0], name)
    first = check_problems[0]
    order = [canonical_name(name)] if name is not None else list(_candidates(default_order(first)))
    refused: list[Verdict] = []
    for candidate in order:
        reasons: list[str] = []
        for i, problem in enumerate(check_problems):
            verdict = judge(candidate, problem)
            reasons += [f"layer kind {i} ({_describe(problem)}): {r}" for r in verdict.reasons]
        if not reasons:
            return load_backend(candidate)
        refused.append(Verdict(candidate, tuple(reasons)))
    what = f"attention backend {order[0]}" if name is not None else "no attention backend"
    raise NoBackendError(f"{what} can serve every layer of this model:\n" + _format(refused))


def _describe(problem: AttentionProblem) -> str:
    spec = problem.spec
    kind = {"cross": "cross attention", "encoder_only": "encoder attention (no cache)"}.get(spec.attn_type.value,
                                                                                             "full attention")
    parts = [f"window {spec.sliding_window}" if spec.sliding_window else kind]
    if spec.has_sinks:
        parts.append("learned sinks")
    if spec.logits_soft_cap is not None:
        parts.append(f"soft-cap {spec.logits_soft_cap}")
    return ", ".join(parts)
