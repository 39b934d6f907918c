"""Measure which attention backend is fastest per problem class on this GPU, and write the
kernel-choice table the registry reads (meshserve/attention/kernel_choice.json).

    python3 -m bench.attention_choice --out $OUT [--write meshserve/attention/kernel_choice.json]
        [--classes gqa-bf16-16,gqa-bf16-64,gqa-fp8-16,gqa-fp8-64,mla-bf16-64,mla-fp8-64] [--quick]
    (mha-bf16-16, mha-fp8-16, ...: Llama-2-7B-shaped MHA 32/32 x 128, measured only when named)

Per class (Llama-3-8B-shaped GQA 32/8 x 128, Llama-2-7B-shaped MHA 32/32 x 128, or DeepSeek-V3-shaped
MLA 128 heads, latent 512 + rope 64; bf16 activations) and phase, every registered backend of the kind that validates on
this device is first run on small batches of the same class against the TORCH reference
(float32 math): a backend whose output or LSE is off by more than the class's tolerance is
dropped from that class and reported (a wrong kernel never wins). The rest are timed as the
engine runs them (plan once on the host, then `forward`; CUDA events, L2 flushed, median) on
the shapes below, and each backend's relative time is its time over the fastest one's, the
mean over the shapes. TORCH itself is the oracle (one sequence at a time, float32): it is
checked against but timed only with --time-reference.

Prefill runs as in the engine's layers (workers/models/transformer.py): forward gets the step's
own K/V beside the query (the new tokens' rows of the cache, in the activation dtype), so whole
fresh prompts take the paths that read them instead of the pages (FLASHINFER's ragged prefill,
TRITON's fresh tiles) and chunks over a cached prefix read the pages; the shapes and the check
batches hold both. FP8 caches: the step's K/V are the dequantized cache rows, and prefill reads
the quantized pages (attention/backend.py step_kv_refusals).

Decode is measured twice per standard class: at size "any" (64x4096, 256x2048, 8x32768) and at
size "short" on short contexts (256x160, 256x512, 64x1024), the decode steps of a server whose
max_model_len is at most kernel_choice.LONG_CONTEXT (the key kernel_choice.py reads: the choice
is made once per server, by its max_model_len). A short-context decode winner that differs from
the prefill winner by more than kernel_choice.SPLIT_MIN_GAIN makes such servers split their
phases over two backends (attention/backends/phase_split.py).

Prints a table, writes attention_choice.json (raw times) and attention_choice.png under --out;
--write merges the measured entries into a kernel-choice table (same class: replaced).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import rel_err, shuffled_tables, time_us_l2_flushed
from meshserve.attention.backend import AttentionProblem, KVCache
from meshserve.attention.kernel_choice import parse_table
from meshserve.attention.metadata import AttentionMetadata
from meshserve.attention.registry import BackendKind, load_backend, tables
from meshserve.attention.spec import AttentionSpec, KVCacheDtype, MLADims

HEADS, KV_HEADS, HEAD = 32, 8, 128
MLA_HEADS = 128
V3 = MLADims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DECODE_SHAPES = ((64, 4096), (256, 2048), (8, 32768))  # (batch, keys)
# Short contexts: many sequences over few keys (a chat server's decode steps), size class "short".
DECODE_SHORT_SHAPES = ((256, 160), (256, 512), (64, 1024))
# (batch, new tokens, cached tokens): whole fresh prompts, and chunks over a cached prefix (a
# prefix-cache hit, or a later chunk of a long prompt).
PREFILL_SHAPES = ((4, 4096, 0), (1, 16384, 0), (4, 1024, 3072))
MLA_DECODE_SHAPES = ((64, 4096), (8, 32768))
QUICK = {"decode": ((64, 4096),), "decode-short": ((256, 512),), "prefill": ((4, 4096, 0), (4, 1024, 3072)),
         "mla": ((64, 4096),)}
# Check batches (query lengths, sequence lengths), decode rows last. Prefill: a chunk over cached
# context beside a whole prompt (paged paths), and whole prompts only (FLASHINFER's ragged prefill
# needs every prefill of the step fresh).
CHECK_BATCHES = {
    "prefill": {"chunk over cached context + fresh prompt": ((37, 64, 1, 1), (300, 64, 1000, 17)),
                "fresh prompts": ((130, 64, 1), (130, 64, 700))},
    "decode": {"decodes": ((1,) * 6, (5, 300, 1000, 17, 64, 700))},
}
TOLERANCE = {"bfloat16": 3e-2, "fp8": 8e-2}  # max |o - ref| / max |ref|, and the same bound on LSE
REFERENCE = "TORCH"
CLASSES = ("gqa-bf16-16", "gqa-bf16-64", "gqa-fp8-16", "gqa-fp8-64", "mla-bf16-64", "mla-fp8-64")


@dataclass(frozen=True)
class Rig:
    """Where the classes run and at what size: the GPU at the Llama-3-8B shape (the bench), or the
    CPU at a toy size under TRITON_INTERPRET=1 (tests: the bench's batches and checks, not speed;
    float16 there, as the interpreter computes bf16 wrongly; a "bf16" class's cache holds `dtype`)."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16  # activations
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head: int = HEAD


GPU = Rig()


@dataclass(frozen=True)
class ProblemClassSpec:
    """One class to measure: 'gqa-bf16-16' = GQA, bf16 K/V, pages of 16. MHA (as many K/V heads as
    query heads) is a class of its own: FLASHINFER decodes it, and GQA groups below 4, without tensor
    cores, another kernel than the GQA class's."""

    attention: str  # "gqa", "mha" or "mla"
    kv: str  # "bf16" or "fp8"
    page: int

    @classmethod
    def parse(cls, text: str) -> ProblemClassSpec:
        attention, kv, page = text.split("-")
        if attention not in ("gqa", "mha", "mla") or kv not in ("bf16", "fp8") or not page.isdigit():
            raise SystemExit(f"--classes: {text!r} is not ATTENTION-KV-PAGE (e.g. gqa-bf16-16, mla-fp8-64)")
        return cls(attention, kv, int(page))

    @property
    def kv_dtype(self) -> KVCacheDtype:
        return KVCacheDtype.FP8_E4M3 if self.kv == "fp8" else KVCacheDtype.AUTO

    def kv_heads(self, rig: Rig = GPU) -> int:
        return rig.heads if self.attention == "mha" else rig.kv_heads

    @property
    def table_attention(self) -> str:
        """The table's attention class (kernel_choice.ATTENTION_CLASSES)."""
        return self.attention.upper()

    @property
    def kv_class(self) -> str:
        return "fp8" if self.kv == "fp8" else "bfloat16"

    def kinds(self) -> tuple[tuple[str, str, str], ...]:
        """(registry kind, phase, size) measured for this class (size: kernel_choice.SIZES)."""
        if self.attention == "mla":
            return (("mla_decode", "decode", "any"),)
        return (("attention", "prefill", "any"), ("attention", "decode", "any"), ("attention", "decode", "short"))

    def problem(self, max_len: int, rig: Rig = GPU) -> AttentionProblem:
        cc = torch.cuda.get_device_capability() if rig.device == "cuda" else None
        if self.attention == "mla":
            from meshserve.attention.mla.spec import mla_spec

            spec = mla_spec(MLA_HEADS, V3, kv_cache_dtype=self.kv_dtype)
        else:
            spec = AttentionSpec(rig.heads, self.kv_heads(rig), rig.head, kv_cache_dtype=self.kv_dtype)
        dtype = str(rig.dtype).removeprefix("torch.")
        return AttentionProblem(spec, dtype=dtype, block_size=self.page, max_model_len=max_len, device=rig.device,
                                compute_capability=cc)  # fmt: skip


@dataclass
class Result:
    """One class and phase: times per backend per shape, and what was dropped and why."""

    cls: ProblemClassSpec
    kind: str
    phase: str
    times_us: dict[str, dict[str, float]] = field(default_factory=dict)  # backend -> shape -> µs
    dropped: dict[str, str] = field(default_factory=dict)  # backend -> reason
    size: str = "any"  # kernel_choice.SIZES: "short" for the short-context decode shapes


# ------------------------------------------------------------------------- standard attention
@dataclass
class GqaBatch:
    """One step of a class as the engine's layer sees it after write_kv: the cache already holds
    every token, the new ones included (metadata write_kv off); `key`/`value` are the new tokens'
    rows of that cache in the activation dtype (FP8: dequantized), what forward gets beside q."""

    cache: KVCache
    meta: AttentionMetadata
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KV_H, D]
    value: torch.Tensor  # [T, KV_H, D]


def _gqa_cache(cls: ProblemClassSpec, num_blocks: int, gen: torch.Generator, rig: Rig) -> KVCache:
    shape = (num_blocks, 2, cls.page, cls.kv_heads(rig), rig.head)
    data = torch.randn(shape, device=rig.device, dtype=rig.dtype, generator=gen)
    if cls.kv != "fp8":
        return KVCache(data, torch.tensor(1.0, device=rig.device), torch.tensor(1.0, device=rig.device))
    scale = torch.tensor(0.25, device=rig.device)
    return KVCache((data / scale).to(torch.float8_e4m3fn), scale, scale.clone())


def _step_kv(cache: KVCache, tables_: list[list[int]], query_lens, seq_lens, dtype: torch.dtype):
    """The new tokens' (key, value) [T, KV_H, D] read back from the cache, in `dtype`."""
    page = cache.block_size
    blocks, offsets = [], []
    for table, q_len, seq_len in zip(tables_, query_lens, seq_lens):
        for pos in range(seq_len - q_len, seq_len):
            blocks.append(table[pos // page])
            offsets.append(pos % page)
    device = cache.data.device
    rows = cache.data[torch.tensor(blocks, device=device), :, torch.tensor(offsets, device=device)]  # [T, 2, KV_H, D]
    scales = (cache.k_scale, cache.v_scale)
    return tuple((rows[:, i].float() * scales[i].float()).to(dtype).contiguous() for i in (0, 1))


def gqa_batch(cls: ProblemClassSpec, query_lens, seq_lens, seed: int, rig: Rig = GPU) -> GqaBatch:
    """Random queries over a random cache of this class, shuffled block tables."""
    gen = torch.Generator(device=rig.device).manual_seed(seed)
    per_seq = -(-max(seq_lens) // cls.page)
    cache = _gqa_cache(cls, len(seq_lens) * per_seq, gen, rig)
    tables_ = shuffled_tables(len(seq_lens), per_seq, torch.Generator().manual_seed(seed))
    meta = AttentionMetadata.build(query_lens=list(query_lens), seq_lens=list(seq_lens), block_tables=tables_,
                                   block_size=cls.page, device=rig.device, write_kv=False)  # fmt: skip
    q = torch.randn(sum(query_lens), rig.heads, rig.head, device=rig.device, dtype=rig.dtype, generator=gen)
    return GqaBatch(cache, meta, q, *_step_kv(cache, tables_, query_lens, seq_lens, rig.dtype))


def gqa_run(backend, batch: GqaBatch):
    """One layer's attention as the engine calls it (plan once per step, then forward with q, k, v)."""
    plan = backend.plan(batch.meta)
    return lambda: backend.forward(batch.query, batch.key, batch.value, batch.cache, plan, return_lse=True)


def check_gqa(cls: ProblemClassSpec, name: str, phase: str, rig: Rig = GPU) -> str | None:
    """None when `name` matches the reference on every check batch of the phase, else why not."""
    prob = cls.problem(2048, rig)
    for what, (query_lens, seq_lens) in CHECK_BATCHES[phase].items():
        batch = gqa_batch(cls, query_lens, seq_lens, seed=11, rig=rig)
        out, lse = gqa_run(load_backend(name)(prob), batch)()
        ref_out, ref_lse = gqa_run(load_backend(REFERENCE)(prob), batch)()
        wrong = _compare(out, lse, ref_out, ref_lse, TOLERANCE[cls.kv_class])
        if wrong:
            return f"{what}: {wrong}"
    return None


def shape_label(phase: str, shape: tuple[int, ...]) -> str:
    """'prefill 4x4096' (fresh prompts), 'prefill 4x1024+3072' (chunks over 3072 cached), 'decode 64x4096'."""
    batch, n, *cached = shape
    return f"{phase} {batch}x{n}" + (f"+{cached[0]}" if cached and cached[0] else "")


def step_lens(phase: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query lengths, sequence lengths) of a timed shape: prefill (batch, new, cached) or decode (batch, keys)."""
    if phase == "prefill":
        batch, new, cached = shape
        return (new,) * batch, (new + cached,) * batch
    batch, seq = shape
    return (1,) * batch, (seq,) * batch


def gqa_shapes(phase: str, size: str, *, quick: bool = False) -> tuple[tuple[int, ...], ...]:
    """The timed shapes of a standard class's phase and size ("short" decode: short contexts)."""
    if phase == "prefill":
        return QUICK["prefill"] if quick else PREFILL_SHAPES
    if size == "short":
        return QUICK["decode-short"] if quick else DECODE_SHORT_SHAPES
    return QUICK["decode"] if quick else DECODE_SHAPES


def time_gqa(cls: ProblemClassSpec, name: str, phase: str, shapes) -> dict[str, float]:
    out = {}
    for shape in shapes:
        query_lens, seq_lens = step_lens(phase, shape)
        step = gqa_batch(cls, query_lens, seq_lens, seed=len(seq_lens) * seq_lens[0])
        fn = gqa_run(load_backend(name)(cls.problem(2 * seq_lens[0])), step)
        out[shape_label(phase, shape)] = time_us_l2_flushed(fn, warmup=3, iters=15 if phase == "prefill" else 30)
        del step, fn
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------ MLA
def _mla_batch(cls: ProblemClassSpec, seq_lens, seed: int):
    from meshserve.attention.mla.backend import MLAWeights
    from meshserve.attention.mla.cache import LatentCache

    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-max(seq_lens) // cls.page)
    blocks = len(seq_lens) * per_seq
    scale = 0.05 if cls.kv == "fp8" else 1.0
    cache = LatentCache.allocate(blocks, cls.page, V3, dtype=torch.bfloat16, kv_cache_dtype=cls.kv_dtype,
                                 device="cuda", scale=scale)  # fmt: skip
    real = torch.randn(cache.data.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    cache.data.copy_((real / scale).to(cache.data.dtype))
    tables_ = shuffled_tables(len(seq_lens), per_seq, torch.Generator().manual_seed(seed))
    meta = AttentionMetadata.build(query_lens=[1] * len(seq_lens), seq_lens=list(seq_lens), block_tables=tables_,
                                   block_size=cls.page, device="cuda", write_kv=False)  # fmt: skip
    q = torch.randn(len(seq_lens), MLA_HEADS, V3.qk_head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(MLA_HEADS, V3.qk_nope_head_dim + V3.v_head_dim, V3.kv_lora_rank, device="cuda",
                    dtype=torch.bfloat16, generator=gen) * V3.kv_lora_rank**-0.5  # fmt: skip
    weights = MLAWeights(w[:, : V3.qk_nope_head_dim], w[:, V3.qk_nope_head_dim :])
    return cache, meta, q, weights


def _mla_run(backend, cache, meta, q, weights):
    plan = backend.plan(meta)
    return lambda: backend.forward(q, cache, plan, weights, return_lse=True)


def check_mla(cls: ProblemClassSpec, name: str, phase: str) -> str | None:
    cache, meta, q, weights = _mla_batch(cls, (5, 300, 1000, 17, 64, 700), seed=12)
    prob = cls.problem(2048)
    out, lse = _mla_run(load_backend(name, BackendKind.MLA_DECODE)(prob), cache, meta, q, weights)()
    ref_out, ref_lse = _mla_run(load_backend(REFERENCE, BackendKind.MLA_DECODE)(prob), cache, meta, q, weights)()
    return _compare(out, lse, ref_out, ref_lse, TOLERANCE[cls.kv_class])


def time_mla(cls: ProblemClassSpec, name: str, phase: str, shapes) -> dict[str, float]:
    out = {}
    for batch, seq in shapes:
        cache, meta, q, weights = _mla_batch(cls, (seq,) * batch, seed=batch + seq)
        fn = _mla_run(load_backend(name, BackendKind.MLA_DECODE)(cls.problem(2 * seq)), cache, meta, q, weights)
        out[f"mla decode {batch}x{seq}"] = time_us_l2_flushed(fn)
        del cache, meta, q, fn
        torch.cuda.empty_cache()
    return out


def _compare(out, lse, ref_out, ref_lse, tol: float) -> str | None:
    err_o = rel_err(out, ref_out)
    finite = torch.isfinite(ref_lse)
    err_lse = rel_err(lse[finite], ref_lse[finite]) if bool(finite.any()) else 0.0
    if not (err_o <= tol and err_lse <= tol):
        return f"output error {err_o:.2e}, LSE error {err_lse:.2e} against {REFERENCE} (tolerance {tol:.0e})"
    return None


# ------------------------------------------------------------------------------- the table
def relative_times(times_us: dict[str, dict[str, float]]) -> dict[str, float]:
    """Backend -> mean over shapes of its time over the fastest time of that shape; only backends
    timed on every shape are ranked (a backend that failed a shape does not win by absence)."""
    shapes = set.union(*(set(t) for t in times_us.values())) if times_us else set()
    complete = {b: t for b, t in times_us.items() if set(t) == shapes}
    if not complete:
        return {}
    best = {s: min(t[s] for t in complete.values()) for s in shapes}
    return {b: round(statistics.fmean(t[s] / best[s] for s in shapes), 3) for b, t in complete.items()}


def triton_version() -> str:
    import triton

    return triton.__version__


def _gpu_model(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the model word of a CUDA device name (else its last word)."""
    words = device.split()
    return next((w for w in words if re.fullmatch(r"[A-Z]+\d{2,4}[A-Za-z]*", w)), words[-1]).lower()


def entries(results: list[Result], *, device: str, capability: str, date: str, command: str) -> list[dict]:
    """kernel_choice.json entries for the measured classes (skips a class where nothing passed)."""
    out = []
    for r in results:
        rel = relative_times(r.times_us)
        if not rel:
            continue
        fastest = min(rel, key=rel.get)
        rel = {b: max(v / rel[fastest], 1.0) for b, v in rel.items()}  # the fastest is 1.0 exactly
        attention = r.cls.table_attention
        size = "" if r.size == "any" else f"-{r.size}"
        out.append({
            "id": f"{_gpu_model(device)}-{r.kind}-{r.phase}-{attention.lower()}-{r.cls.kv}-page{r.cls.page}{size}",
            "kind": r.kind, "phase": r.phase, "attention": attention, "kv": r.cls.kv_class,
            "capability": capability, "page_size": r.cls.page, "size": r.size, "fastest": fastest,
            "relative": {b: round(v, 3) for b, v in sorted(rel.items())},
            "shapes": ", ".join(next(iter(r.times_us.values()))),
            "source": {"command": command, "date": date, "device": device}
            | ({"dropped": "; ".join(f"{b}: {why}" for b, why in r.dropped.items())} if r.dropped else {}),
        })  # fmt: skip
    return out


def merge(doc: dict, new: list[dict]) -> dict:
    """`doc` with `new` entries replacing those of the same class; the result must parse."""
    def key(e: dict):
        return (e["kind"], e["phase"], e["attention"], e["kv"], str(e["capability"]), e.get("page_size"),
                e.get("size", "any"))

    fresh = {key(e) for e in new}
    merged = dict(doc, entries=[e for e in doc.get("entries", []) if key(e) not in fresh] + new)
    parse_table(merged)
    return merged


# --------------------------------------------------------------------------------- driver
def measurement_name(phase: str, size: str) -> str:
    """'prefill', 'decode', 'decode-short': what --only names (size "any" unnamed)."""
    return phase if size == "any" else f"{phase}-{size}"


def measure(cls: ProblemClassSpec, *, quick: bool, time_reference: bool,
            only: frozenset[str] | None = None) -> list[Result]:  # fmt: skip
    """Every (kind, phase, size) of `cls` (or those `only` names: measurement_name) checked and timed."""
    results = []
    for kind, phase, size in cls.kinds():
        if only is not None and measurement_name(phase, size) not in only:
            continue
        r = Result(cls, kind, phase, size=size)
        backends, _ = tables(kind)
        if cls.attention == "mla":
            check, timer, shapes = check_mla, time_mla, QUICK["mla"] if quick else MLA_DECODE_SHAPES
        else:
            check, timer = check_gqa, time_gqa
            shapes = gqa_shapes(phase, size, quick=quick)
        longest = max(max(step_lens(phase, shape)[1]) for shape in shapes)
        for name in backends:
            if name == REFERENCE and not time_reference:
                continue
            try:
                reasons = load_backend(name, kind).validate_configuration(cls.problem(2 * longest))
            except ImportError as exc:
                reasons = [f"cannot be imported: {exc}"]
            if reasons:
                r.dropped[name] = "; ".join(reasons)
                continue
            try:
                wrong = check(cls, name, phase)
                if wrong:
                    r.dropped[name] = wrong
                    continue
                r.times_us[name] = timer(cls, name, phase, shapes)
            except Exception as exc:  # a kernel that fails to build or run is dropped, the rest measured
                r.dropped[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"  {cls} {phase} {size} {name}: {r.times_us.get(name) or r.dropped.get(name)}", flush=True)
        results.append(r)
    return results


def report(results: list[Result]) -> str:
    lines = ["| class | phase | backend | shape | µs | relative |", "|---|---|---|---|---|---|"]
    for r in results:
        rel = relative_times(r.times_us)
        c = f"{r.cls.attention}-{r.cls.kv}-{r.cls.page}" + ("" if r.size == "any" else f" ({r.size})")
        for b, t in r.times_us.items():
            for shape, us in t.items():
                lines.append(f"| {c} | {r.phase} | {b} | {shape} | {us:.1f} | {rel.get(b, float('nan')):.3f} |")
        for b, why in r.dropped.items():
            lines.append(f"| {c} | {r.phase} | {b} | dropped | - | {why[:120]} |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    labels, series = [], {}
    for r in results:
        rel = relative_times(r.times_us)
        size = "" if r.size == "any" else f" {r.size}"
        labels.append(f"{r.cls.attention}-{r.cls.kv}-{r.cls.page}\n{r.phase}{size}")
        for b in set(series) | set(rel):
            series.setdefault(b, [float("nan")] * (len(labels) - 1)).append(rel.get(b, float("nan")))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    width = 0.8 / max(len(series), 1)
    for i, (b, ys) in enumerate(sorted(series.items())):
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=b)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("time / fastest")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


MEASUREMENTS = ("prefill", "decode", "decode-short")


def parse_only(text: str | None) -> frozenset[str] | None:
    """--only's measurements (None: all), each one of MEASUREMENTS."""
    if text is None:
        return None
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names or not names <= set(MEASUREMENTS):
        raise SystemExit(f"--only: {text!r} is not a comma-separated list of {', '.join(MEASUREMENTS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, from {', '.join(CLASSES)}")
    ap.add_argument("--write", type=Path, default=None, help="merge the entries into this kernel-choice table")
    ap.add_argument("--quick", action="store_true", help="one shape per phase and prefill path (less device time)")
    ap.add_argument("--only", default=None,
                    help="comma-separated measurements of each class: prefill, decode, decode-short (default: all)")
    ap.add_argument("--time-reference", action="store_true", help=f"time {REFERENCE} too (slow)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.attention_choice measures GPU kernels: no CUDA device here")
    classes = [ProblemClassSpec.parse(c) for c in args.classes.split(",") if c]
    only = parse_only(args.only)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for cls in classes:
        results += measure(cls, quick=args.quick, time_reference=args.time_reference, only=only)
    print(report(results))
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    command = "python3 -m bench.attention_choice " + " ".join(argv if argv is not None else sys.argv[1:])
    try:  # the versions the entries hold for: a FlashInfer or Triton release can reorder them
        import flashinfer

        command += f" (flashinfer {flashinfer.__version__}, triton {triton_version()})"
    except ImportError:
        command += f" (no flashinfer, triton {triton_version()})"
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    new = entries(results, device=device, capability=capability, date=date, command=command)
    raw = [dict(cls=r.cls.__dict__, kind=r.kind, phase=r.phase, size=r.size, times_us=r.times_us, dropped=r.dropped)
           for r in results]  # fmt: skip
    (args.out / "attention_choice.json").write_text(json.dumps(dict(device=device, date=date, results=raw,
                                                                    entries=new), indent=1))  # fmt: skip
    plot(results, args.out / "attention_choice.png")
    if args.write is not None:
        doc = json.loads(args.write.read_text()) if args.write.exists() else {"entries": []}
        args.write.write_text(json.dumps(merge(doc, new), indent=2) + "\n")
        print(f"wrote {len(new)} entries into {args.write}")


if __name__ == "__main__":
    main()
