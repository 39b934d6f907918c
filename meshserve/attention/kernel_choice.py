"""The measured choice of attention kernel on CUDA: a table of problem classes and the backend
that was fastest for each, read from kernel_choice.json (written by bench/attention_choice.py).

A problem class is (kind, phase, attention MHA/GQA/MLA, KV storage dtype, compute capability,
page size, size bucket). A layer of kind `attention` runs both phases, so its order comes from
the prefill and the decode entry of its class together (each backend ranked by the sum of its
relative times, 1.0 = the fastest); `mla_decode` and `mla_prefill` use one phase each. Where any
phase of the class has no entry, or the device is not CUDA, the registry's fixed priority list
applies unchanged ("fallback"). A table entry only reorders: validation still runs, so a backend
that cannot serve the problem is passed over exactly as before.

Phase split (kind `attention` only): where the two phases' fastest backends differ and a phase's
fastest beats the best single backend (the sum's winner) in that phase by at least
SPLIT_MIN_GAIN, the choice also names a split (prefill backend, decode backend): the layer then
runs attention/backends/phase_split.py over one cache. The margin keeps measurement noise
(relative times of 1.006..1.015 between FLASHINFER and TRITON decode in today's table) from
splitting; a split costs nothing per step beyond a second plan on mixed steps.

Size buckets are keyed by max_model_len, the one length known when a server picks its kernels
(it picks once, not per step): "short" for max_model_len <= LONG_CONTEXT, "long" above, "any"
for an entry measured over both. A short server never decodes past LONG_CONTEXT and most of its
decode steps attend over far fewer keys, so bench/attention_choice.py measures a "short" decode
entry on short contexts (256x160, 256x512, 64x1024) beside the "any" one (64x4096, 256x2048,
8x32768); the more specific entry wins where both match. Choosing per step by the step's own
context lengths would need a per-step dispatch between two plans; not built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path

from meshserve.attention.backend import AttentionProblem
from meshserve.errors import ConfigError, check

TABLE_PATH = Path(__file__).with_name("kernel_choice.json")
LONG_CONTEXT = 8192  # size bucket "long": max_model_len above this
# A phase's fastest backend must beat the best single backend in that phase by this factor (time
# over time, from the relative times) before a standard layer splits its phases over two backends.
SPLIT_MIN_GAIN = 1.05


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


PHASES_OF_KIND: dict[str, tuple[Phase, ...]] = {
    "attention": (Phase.PREFILL, Phase.DECODE),
    "mla_decode": (Phase.DECODE,),
    "mla_prefill": (Phase.PREFILL,),
    "mla_sparse": (Phase.PREFILL, Phase.DECODE),
}
ATTENTION_CLASSES = ("MHA", "GQA", "MLA")
KV_CLASSES = ("bfloat16", "float16", "float32", "fp8")
SIZES = ("any", "short", "long")


@dataclass(frozen=True)
class ProblemClass:
    """What a table entry is keyed by (page_size None in an entry: any page size)."""

    kind: str
    phase: Phase
    attention: str
    kv: str
    capability: str  # "9.0"
    page_size: int | None
    size: str

    def describe(self) -> str:
        page = "any page" if self.page_size is None else f"page {self.page_size}"
        return f"{self.kind} {self.phase} {self.attention} kv {self.kv} sm{self.capability} {page} size {self.size}"


@dataclass(frozen=True)
class Entry:
    """One measured problem class: `relative` is each backend's time over the fastest one's."""

    id: str
    key: ProblemClass
    fastest: str
    relative: dict[str, float]
    source: dict[str, str]
    shapes: str = ""

    def matches(self, want: ProblemClass) -> bool:
        k = self.key
        return (
            (k.kind, k.phase, k.attention, k.kv, k.capability) == (want.kind, want.phase, want.attention, want.kv,
                                                                  want.capability)
            and (k.page_size is None or k.page_size == want.page_size)
            and (k.size == "any" or k.size == want.size)
        )  # fmt: skip

    @property
    def specificity(self) -> int:
        return (self.key.page_size is not None) + (self.key.size != "any")


@dataclass(frozen=True)
class Choice:
    """The candidate order for one problem, and why: the entries used, or why none applied."""

    order: tuple[str, ...]
    entries: tuple[Entry, ...]
    reason: str
    split: tuple[str, str] | None = None  # (prefill, decode) backends, tried before `order` (kind attention)
    split_why: str = ""  # phase_split's verdict, split or not (empty where the phases' fastest agree)

    @property
    def from_table(self) -> bool:
        return bool(self.entries)


def parse_table(data: dict) -> tuple[Entry, ...]:
    """Entries of a kernel_choice.json document, checked field by field (ConfigError names the field)."""
    check(isinstance(data, dict) and isinstance(data.get("entries"), list), "kernel_choice", type(data).__name__,
          'an object with an "entries" list')  # fmt: skip
    out: list[Entry] = []
    for i, raw in enumerate(data["entries"]):
        where = f"kernel_choice.entries[{i}]"
        kind = raw.get("kind")
        check(kind in PHASES_OF_KIND, f"{where}.kind", kind, f"one of {sorted(PHASES_OF_KIND)}")
        phase = raw.get("phase")
        check(phase in {p.value for p in PHASES_OF_KIND[kind]}, f"{where}.phase", phase,
              f"a phase of kind {kind}: {[str(p) for p in PHASES_OF_KIND[kind]]}")  # fmt: skip
        check(raw.get("attention") in ATTENTION_CLASSES, f"{where}.attention", raw.get("attention"),
              f"one of {list(ATTENTION_CLASSES)}")  # fmt: skip
        check(raw.get("kv") in KV_CLASSES, f"{where}.kv", raw.get("kv"), f"one of {list(KV_CLASSES)}")
        cap = str(raw.get("capability", ""))
        major, _, minor = cap.partition(".")
        check(major.isdigit() and minor.isdigit(), f"{where}.capability", cap, 'MAJOR.MINOR, e.g. "9.0"')
        page = raw.get("page_size")
        check(page is None or (isinstance(page, int) and page >= 1), f"{where}.page_size", page,
              "a positive integer, or null for any page size")  # fmt: skip
        check(raw.get("size", "any") in SIZES, f"{where}.size", raw.get("size"), f"one of {list(SIZES)}")
        rel = raw.get("relative")
        check(isinstance(rel, dict) and rel and all(isinstance(v, (int, float)) and v >= 1.0 for v in rel.values()),
              f"{where}.relative", rel, "{backend: time over the fastest's time, >= 1.0}")  # fmt: skip
        fastest = raw.get("fastest")
        check(fastest == min(rel, key=rel.get), f"{where}.fastest", fastest,
              f"the backend with the smallest relative time ({min(rel, key=rel.get)})")  # fmt: skip
        source = raw.get("source")
        check(isinstance(source, dict) and all(source.get(k) for k in ("command", "date", "device")),
              f"{where}.source", source, "an object with command, date and device")  # fmt: skip
        key = ProblemClass(kind, Phase(phase), raw["attention"], raw["kv"], cap, page, raw.get("size", "any"))
        out.append(Entry(str(raw.get("id", f"entry {i}")), key, fastest, dict(rel), dict(source),
                         raw.get("shapes", "")))  # fmt: skip
    return tuple(out)


@cache
def load_table(path: Path = TABLE_PATH) -> tuple[Entry, ...]:
    """The table shipped with the package (read once)."""
    try:
        return parse_table(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ConfigError("kernel_choice", str(path), f"valid JSON ({exc})") from exc


def problem_class(problem: AttentionProblem, kind: str, phase: Phase) -> ProblemClass | None:
    """The class `problem` falls in for `phase`, or None off CUDA (the table is about GPU kernels)."""
    if problem.device != "cuda" or problem.compute_capability is None:
        return None
    spec = problem.spec
    if spec.mla is not None:
        attention = "MLA"
    else:
        attention = "MHA" if spec.num_kv_heads == spec.num_heads else "GQA"
    kv = "fp8" if spec.kv_cache_dtype.is_fp8 else problem.dtype
    cc = problem.compute_capability
    size = "long" if problem.max_model_len > LONG_CONTEXT else "short"
    return ProblemClass(kind, phase, attention, kv, f"{cc[0]}.{cc[1]}", problem.block_size, size)


def choose(problem: AttentionProblem, kind: str, fallback: tuple[str, ...],
           table: tuple[Entry, ...] | None = None) -> Choice:  # fmt: skip
    """The order in which to try backends for `problem`: measured ones first, fastest first (by
    the sum of relative times over the phases the kind runs), then `fallback`'s in its order."""
    table = load_table() if table is None else table
    entries: list[Entry] = []
    for phase in PHASES_OF_KIND[kind]:
        want = problem_class(problem, kind, phase)
        if want is None:
            return Choice(fallback, (), "fallback: not a CUDA problem (the table holds GPU measurements)")
        found = [e for e in table if e.matches(want)]
        if not found:
            return Choice(fallback, (), f"fallback: no measurement for {want.describe()}")
        entries.append(max(found, key=lambda e: e.specificity))
    measured = set.intersection(*(set(e.relative) for e in entries))
    score = {name: sum(e.relative[name] for e in entries) for name in measured}
    ranked = tuple(sorted(measured, key=lambda n: (score[n], fallback.index(n) if n in fallback else len(fallback))))
    order = ranked + tuple(n for n in fallback if n not in ranked)
    used = ", ".join(f"{e.id} ({e.fastest} fastest; {e.source['device']}, {e.source['date']})" for e in entries)
    split, why = phase_split(entries, ranked) if kind == "attention" and ranked else (None, "")
    return Choice(order, tuple(entries), f"table: {used}" + (f"; {why}" if why else ""), split, why)


def phase_split(entries: list[Entry], ranked: tuple[str, ...]) -> tuple[tuple[str, str] | None, str]:
    """(prefill, decode) backends when the phases' fastest differ and one of them beats the best
    single backend `ranked[0]` in its phase by SPLIT_MIN_GAIN or more (else None), and why."""
    best = ranked[0]
    measured = [n for n in ranked if all(n in e.relative for e in entries)]
    winners = tuple(min(measured, key=lambda n, e=e: (e.relative[n], measured.index(n))) for e in entries)
    if winners[0] == winners[1]:
        return None, ""
    gains = [e.relative[best] / e.relative[w] for e, w in zip(entries, winners)]  # [prefill, decode]
    i = max((0, 1), key=lambda j: gains[j])
    said = (f"{('prefill', 'decode')[i]}: {winners[i]} {gains[i]:.3f}x faster than {best}; "
            f"split margin SPLIT_MIN_GAIN {SPLIT_MIN_GAIN}")  # fmt: skip
    if gains[i] < SPLIT_MIN_GAIN:
        return None, f"no phase split ({said})"
    return winners, f"phase split prefill {winners[0]} + decode {winners[1]} ({said})"
