"""`meshserve backends | doctor | generate | serve | bench | client` — the command-line boundary.

Strings become enums and configs here; every subcommand is a small function.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys

from meshserve.errors import ConfigError, MeshserveError


def _add_layer_flags(p: argparse.ArgumentParser) -> None:
    from meshserve.attention.spec import AttentionType, KVCacheDtype
    from meshserve.config import DEFAULT_BLOCK_SIZE

    g = p.add_argument_group("the attention layer to choose a backend for")
    g.add_argument("--num-heads", type=int, default=32)
    g.add_argument("--num-kv-heads", type=int, default=8)
    g.add_argument("--head-size", type=int, default=128)
    g.add_argument("--dtype", default=None, help="float32, float16, bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=[d.value for d in KVCacheDtype])
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--attn-type", default="decoder", choices=[t.value for t in AttentionType])
    g.add_argument("--sliding-window", type=int, default=None)
    g.add_argument("--sinks", action="store_true", help="learned per-head sink logits (GPT-OSS)")
    g.add_argument("--sink-tokens", type=int, default=0, help="StreamingLLM sink tokens kept with the window")
    g.add_argument("--alibi", action="store_true")
    g.add_argument("--soft-cap", type=float, default=None)
    g.add_argument("--needs-lse", action="store_true", help="the layer runs under DCP")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: this machine")
    g.add_argument("--compute-capability", default=None,
                   help="plan for this CUDA compute capability, e.g. 8.0 (default: this machine's GPU)")
    g.add_argument("--attention-backend", default=None,
                   help="validate this backend instead of choosing (or a phase split prefill=NAME,decode=NAME)")
    m = p.add_argument_group("a multi-head latent attention layer (DeepSeek-V2/V3) instead")
    m.add_argument("--kv-lora-rank", type=int, default=None, help="set to describe an MLA layer (e.g. 512)")
    m.add_argument("--qk-rope-head-dim", type=int, default=64)
    m.add_argument("--qk-nope-head-dim", type=int, default=128)
    m.add_argument("--v-head-dim", type=int, default=128)
    m.add_argument("--mla-decode-backend", default=None, help="validate this MLA decode backend")
    m.add_argument("--mla-prefill-backend", default=None, help="validate this MLA prefill backend")
    p.add_argument("--quiet", action="store_true", help="only the selection, not the feature table")


def cmd_backends(args: argparse.Namespace) -> int:
    import torch

    from meshserve.attention.backend import AttentionProblem
    from meshserve.attention.docs import feature_table
    from meshserve.attention.registry import BackendKind, canonical_name, explain, judge, platform_of, select_backend
    from meshserve.attention.spec import AttentionSpec

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cc = torch.cuda.get_device_capability() if device == "cuda" and torch.cuda.is_available() else None
    if args.compute_capability is not None:
        major, _, minor = args.compute_capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ConfigError("compute_capability", args.compute_capability, "MAJOR.MINOR, e.g. 9.0")
        cc = (int(major), int(minor))
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.kv_lora_rank is not None:
        spec = _mla_spec(args)
    else:
        spec = AttentionSpec(
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
            attn_type=args.attn_type, sliding_window=args.sliding_window, has_sinks=args.sinks,
            num_sink_tokens=args.sink_tokens, use_alibi=args.alibi, logits_soft_cap=args.soft_cap,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    problem = AttentionProblem(spec=spec, dtype=dtype, block_size=args.block_size,
                               max_model_len=args.max_model_len, device=device, compute_capability=cc,
                               needs_lse=args.needs_lse)
    if not args.quiet:
        print(feature_table())
    where = f"{device}" + (f" sm{cc[0]}{cc[1]}" if cc else "")
    print(f"\nThis machine: {where} (priority list '{platform_of(problem)}'), dtype {dtype}, "
          f"block_size {args.block_size}, max_model_len {args.max_model_len}")
    if args.kv_lora_rank is None:
        choices = [(BackendKind.ATTENTION, args.attention_backend)]
    else:
        choices = [(BackendKind.MLA_DECODE, args.mla_decode_backend),
                   (BackendKind.MLA_PREFILL, args.mla_prefill_backend)]  # fmt: skip
    for kind, name in choices:
        if kind is not BackendKind.ATTENTION:
            print(f"{kind}:")
        verdicts = explain(problem, kind)
        if name and kind is BackendKind.ATTENTION and "=" in name:  # a named phase split: its own verdict
            verdicts = [judge(canonical_name(name), problem), *verdicts]
        for verdict in verdicts:
            print(f"  {verdict.name:<11} " + ("valid" if verdict.ok else "refused: " + "; ".join(verdict.reasons)))
        chosen = select_backend(problem, name, kind=kind)
        print("Selected" + ("" if kind is BackendKind.ATTENTION else f" for {kind}") + f": {chosen.name}"
              + (" (named)" if name else f" ({_why_default(problem, kind, chosen)})"))
    _print_weight_formats(device, cc, table=not args.quiet)
    return 0


def _why_default(problem, kind, chosen_cls) -> str:
    """Why automatic selection gave `chosen_cls`: the kernel-choice table entry (and its phase-split
    verdict) or the priority list, and for FLASHINFER which of FlashInfer's own kernels each phase runs."""
    from meshserve.attention.backends.flashinfer_kernels import decode_kernel, mla_decode_kernel, prefill_kernel
    from meshserve.attention.backends.phase_split import PhaseSplitBackend
    from meshserve.attention.registry import BackendKind, default_order

    choice = default_order(problem, kind)
    why = choice.reason if choice.from_table else f"{choice.reason}; priority list order"
    split = isinstance(chosen_cls, type) and issubclass(chosen_cls, PhaseSplitBackend)
    phases = ((chosen_cls.prefill_backend.name, chosen_cls.decode_backend.name) if split
              else (chosen_cls.name, chosen_cls.name))  # fmt: skip
    chosen = chosen_cls.name
    if choice.split is not None and not split:
        why += "; the phase split cannot serve it"
    if not split and choice.order and choice.order[0] != chosen:
        why += f"; {', '.join(choice.order[: choice.order.index(chosen)])} cannot serve it"
    if "FLASHINFER" in phases and kind is BackendKind.ATTENTION:
        kernels = {"prefill": prefill_kernel(problem), "decode": decode_kernel(problem)}
        why += "; FlashInfer kernels: " + ", ".join(f"{p} {k}" for (p, k), n in zip(kernels.items(), phases)
                                                   if n == "FLASHINFER")
    elif chosen == "FLASHINFER" and kind is BackendKind.MLA_DECODE:
        why += f"; FlashInfer kernel: {mla_decode_kernel(problem)}"
    if kind is BackendKind.ATTENTION and phases[0] in ("TRITON", "FLASHINFER"):
        why += "; " + _fresh_prefill_verdict(problem, phases[0])
    return why


def _fresh_prefill_verdict(problem, chosen: str) -> str:
    """Whether prompts with no cached context read the step's own K/V instead of the pages, and why not."""
    if chosen == "TRITON":
        from meshserve.attention.backends.triton_paged import TritonBackend

        backend = TritonBackend(problem)
        reasons = backend.fresh_kv_reasons()
    else:
        from meshserve.attention.backends.flashinfer import FlashInferBackend

        reasons = FlashInferBackend(problem).ragged_prefill_reasons()
    return "fresh prompts from the step's K/V: " + ("on" if not reasons else f"off ({'; '.join(reasons)})")


def cmd_doctor(args: argparse.Namespace) -> int:
    from meshserve.attention.selftest import check_backends

    results = check_backends(args.device)
    for r in results:
        print(f"{r.name:<11} {r.status.upper():<6} {r.detail}")
    required = [n.strip().upper() for n in (args.require or "").split(",") if n.strip()]
    by_name = {r.name: r for r in results}
    unknown = [n for n in required if n not in by_name]
    if unknown:
        raise ConfigError("--require", ",".join(unknown), f"backend names among {sorted(by_name)}")
    failed = [r.name for r in results if r.status == "fail"]
    missing = [n for n in required if by_name[n].status != "pass"]
    passed = [r.name for r in results if r.status == "pass"]
    if failed or missing or not passed:
        print(f"doctor: FAILED (failed: {failed or 'none'}; required but not passing: {missing or 'none'})")
        return 1
    print(f"doctor: OK ({', '.join(passed)} pass)")
    return 0


def _print_weight_formats(device: str, cc: tuple[int, int] | None, *, table: bool) -> None:
    """Quantized weight formats on this machine: which are served, how, or why not (quant/support.py)."""
    from meshserve.workers.quant.formats import WeightFormat
    from meshserve.workers.quant.support import SUPPORT, refusals, support_table

    if table:
        print("\nWeight formats:\n" + support_table())
    print(f"\nWeight formats on {device}" + (f" sm{cc[0]}{cc[1]}" if cc else "") + ":")
    for fmt in WeightFormat:
        reasons = refusals(fmt, device, cc, (128, 128))
        how = next((s.compute for s in SUPPORT if s.format is fmt and s.device == device), "")
        print(f"  {fmt:<11} " + (f"valid: {how}" if not reasons else "refused: " + "; ".join(reasons)))


def _mla_spec(args: argparse.Namespace):
    from meshserve.attention.mla.spec import mla_spec
    from meshserve.attention.spec import MLADims

    dims = MLADims(kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
                   qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim)  # fmt: skip
    return mla_spec(args.num_heads, dims, kv_cache_dtype=args.kv_cache_dtype)


def _add_backends(sub) -> None:
    p = sub.add_parser("backends", help="attention backend feature table and selection for this machine")
    _add_layer_flags(p)
    p.set_defaults(func=cmd_backends)


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="run one tiny attention step through every backend this machine has "
                       "and say which work (an image's smoke test)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--require", default=None, help="comma-separated backends that must pass (e.g. TRITON,FLASHINFER)")
    p.set_defaults(func=cmd_doctor)


def _lazy(module: str, function: str):
    def add(sub) -> None:
        import importlib

        getattr(importlib.import_module(module), function)(sub)

    return add


# Each subcommand's parser, in `meshserve --help` order. Some live in heavy modules (generate's
# imports the whole engine): a command line naming one subcommand builds only its parser.
COMMANDS = {
    "backends": _add_backends,
    "doctor": _add_doctor,
    "generate": _lazy("meshserve.api.llm", "add_generate_parser"),
    "embed": _lazy("meshserve.embed_cli", "add_embed_parser"),
    "serve": _lazy("meshserve.api.serve", "add_serve_parser"),
    "client": _lazy("meshserve.api.client_cli", "add_client_parser"),
    "bench": _lazy("meshserve.api.bench.command", "add_bench_parser"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only `command`'s subparser when it names one."""
    parser = argparse.ArgumentParser(prog="meshserve", description="Distributed LLM inference runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in COMMANDS.items():
        if command in (None, name) or command not in COMMANDS:
            add(sub)
    return parser


def _closest_flags(parser: argparse.ArgumentParser, command: str | None, unknown: list[str]) -> list[str]:
    """'--tensor-paralel-size (did you mean --tensor-parallel-size?)' for each unknown flag."""
    sub = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub = action.choices[command]
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    out = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("-"):
            out.append(arg)
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        out.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.exit(2, f"meshserve {args.command}: error: unrecognized arguments: "
                       f"{' '.join(_closest_flags(parser, args.command, unknown))}\n")
    previous = signal.signal(signal.SIGINT, _interrupt_handler())
    try:
        return args.func(args)
    except MeshserveError as exc:
        print(f"meshserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshserve: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_handler():
    """The first Ctrl-C raises KeyboardInterrupt, so clean-up runs (ranks stopped, Ray shut down); a
    second one during that clean-up ends the process at once. (`serve` handles its own signals
    on its event loop the same way: the first drains, the second exits.)"""
    interrupted = False

    def handler(signum, frame) -> None:
        nonlocal interrupted
        if interrupted:
            os.write(2, b"meshserve: interrupted again: exiting now\n")
            os._exit(130)
        interrupted = True
        raise KeyboardInterrupt

    return handler


if __name__ == "__main__":
    sys.exit(main())
