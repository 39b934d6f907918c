"""The backend feature table, generated from the registry's declared capabilities.

`python -m meshserve.attention.docs --write docs/attention-backends.md` refreshes the generated
block of that page; a test fails when the page is stale. The CLI prints the same table.
"""

from __future__ import annotations

from meshserve.attention.backend import AttentionProblem, BackendCapabilities
from meshserve.attention.kernel_choice import LONG_CONTEXT, SPLIT_MIN_GAIN, choose, load_table
from meshserve.attention.registry import BackendKind, load_backend, tables
from meshserve.attention.spec import AttentionSpec, KVCacheDtype
from meshserve.core.generated_docs import docs_main, replace_block

BEGIN, END = "<!-- BEGIN GENERATED: backend table -->", "<!-- END GENERATED: backend table -->"
SECTIONS = (
    (BackendKind.ATTENTION, "Standard attention"),
    (BackendKind.MLA_DECODE, "Multi-head latent attention: decode"),
    (BackendKind.MLA_PREFILL, "Multi-head latent attention: prefill"),
    (BackendKind.MLA_SPARSE, "Sparse multi-head latent attention (DeepSeek-V3.2 indexer top-k): prefill and decode"),
)


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def _rows(caps: BackendCapabilities) -> dict[str, str]:
    layouts = [name for name, ok in (("paged", caps.paged_layout), ("naive", caps.naive_layout)) if ok]
    cc = "-"
    if caps.min_compute_capability or caps.max_compute_capability:
        lo = ".".join(map(str, caps.min_compute_capability or (0, 0)))
        hi = ".".join(map(str, caps.max_compute_capability)) if caps.max_compute_capability else "+"
        cc = f"{lo}..{hi}" if hi != "+" else f">= {lo}"
    head = f"{caps.min_head_size}..{caps.max_head_size}"
    if caps.head_size_multiple > 1:
        head += f" (x{caps.head_size_multiple})"
    return {
        "devices": ", ".join(sorted(caps.devices)),
        "compute capability": cc,
        "dtypes": ", ".join(sorted(caps.dtypes)),
        "KV cache dtypes": ", ".join(sorted(str(d) for d in caps.kv_cache_dtypes)),
        "layouts": ", ".join(layouts),
        "paged block sizes": f"{caps.min_block_size}..{caps.max_block_size}" if caps.paged_layout else "-",
        "head sizes": head,
        "attention types": ", ".join(sorted(str(t) for t in caps.attention_types)),
        "sliding window": _yes(caps.sliding_window),
        "learned sinks": _yes(caps.learned_sinks),
        "StreamingLLM sink tokens": _yes(caps.sink_tokens),
        "ALiBi": _yes(caps.alibi),
        "logit soft-cap": _yes(caps.soft_cap),
        "MLA": _yes(caps.mla),
        "sparse MLA (indexer top-k)": _yes(caps.sparse_mla),
        "returns LSE": _yes(caps.returns_lse),
        "DCP-sharded cache": _yes(caps.dcp),
        "CUDA graphs": _yes(caps.cuda_graphs),
        "required packages": ", ".join(caps.required_packages) or "-",
        "notes": caps.notes or "-",
    }


def kind_table(kind: BackendKind = BackendKind.ATTENTION) -> str:
    """Markdown: one column per backend registered for `kind`, one row per capability."""
    backends, priorities = tables(kind)
    columns: dict[str, dict[str, str]] = {}
    for name in backends:
        try:
            columns[name] = _rows(load_backend(name, kind).capabilities)
        except ImportError as exc:
            columns[name] = {"notes": f"cannot be imported here: {exc}"}
    features = list(next(iter(c for c in columns.values() if len(c) > 1)).keys())
    lines = ["| feature | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for feature in features:
        lines.append(f"| {feature} | " + " | ".join(c.get(feature, "?") for c in columns.values()) + " |")
    lines += ["", "Fallback priority (automatic selection takes the first valid backend, in this order where the "
              "measured kernel-choice table below has no entry for the problem's class):", ""]
    lines += [f"- `{platform}`: {' > '.join(order)}" for platform, order in priorities.items()]
    return "\n".join(lines)


def choice_table() -> str:
    """Markdown: the measured kernel choice on CUDA (kernel_choice.json), one row per entry."""
    lines = [
        "Automatic selection on CUDA tries backends in the measured order of `meshserve/attention/"
        "kernel_choice.json` (written by `bench/attention_choice.py`) where it has every phase of the "
        "problem's class; `meshserve backends` says which applied. relative: time over the fastest's. "
        "size: by max_model_len (short <= 8192 < long; any: both).",
        "",
        "| kind | phase | attention | KV | sm | page | size | fastest | relative | measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in load_table():
        k = e.key
        rel = ", ".join(f"{n} {v:.2f}" for n, v in sorted(e.relative.items(), key=lambda kv: kv[1]))
        lines.append(f"| {k.kind} | {k.phase} | {k.attention} | {k.kv} | {k.capability} | "
                     f"{k.page_size or 'any'} | {k.size} | {e.fastest} | {rel} | {e.source['device']}, "
                     f"{e.source['date']} |")
    lines += ["", f"Phase split of standard layers (a phase's fastest must beat the best single backend there by "
              f"SPLIT_MIN_GAIN = {SPLIT_MIN_GAIN}):", ""]
    lines += [f"- {verdict}" for verdict in split_verdicts()] or ["- no standard-attention class is measured"]
    return "\n".join(lines)


def split_verdicts() -> list[str]:
    """Per measured standard-attention class (and size bucket where its entries differ): the single
    backend or the phase split kernel_choice.choose gives, and why."""
    out: dict[str, dict[str, str]] = {}
    for e in load_table():
        k = e.key
        if k.kind != "attention":
            continue
        kv = KVCacheDtype.FP8_E4M3 if k.kv == "fp8" else KVCacheDtype.AUTO
        dtype = "bfloat16" if k.kv == "fp8" else k.kv
        heads = 8 if k.attention == "MHA" else 32
        for max_len in (LONG_CONTEXT, 4 * LONG_CONTEXT):
            problem = AttentionProblem(AttentionSpec(heads, 8, 128, kv_cache_dtype=kv), dtype=dtype,
                                       block_size=k.page_size or 16, max_model_len=max_len, device="cuda",
                                       compute_capability=tuple(map(int, k.capability.split("."))))  # fmt: skip
            choice = choose(problem, "attention", ())
            if not choice.from_table:
                continue
            what = choice.order[0] if choice.split is None else "split"
            size = "short" if max_len <= LONG_CONTEXT else "long"
            out.setdefault(f"{k.attention} {k.kv} sm{k.capability} page {k.page_size or 'any'}", {})[size] = (
                f"{what}; {choice.split_why or 'no phase split (the same fastest in both phases)'}")
    lines = []
    for cls, by_size in out.items():
        if len(set(by_size.values())) == 1:
            lines.append(f"{cls}: {next(iter(by_size.values()))}")
        else:
            lines += [f"{cls}, size {size}: {verdict}" for size, verdict in by_size.items()]
    return lines


def feature_table() -> str:
    """Every kind's table under its own heading: standard attention, then MLA decode, prefill, sparse;
    then the measured kernel choice."""
    kinds = "\n\n".join(f"### {title}\n\n{kind_table(kind)}" for kind, title in SECTIONS)
    return f"{kinds}\n\n### Measured kernel choice (CUDA)\n\n{choice_table()}"


def render_page(page: str) -> str:
    """`page` with its generated block replaced by the current table."""
    return replace_block(page, BEGIN, END, feature_table())


def main() -> None:
    docs_main(__doc__, feature_table, render_page)


if __name__ == "__main__":
    main()
