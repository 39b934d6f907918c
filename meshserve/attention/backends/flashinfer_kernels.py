"""Which of FlashInfer's own kernels the FLASHINFER backends ask for (pure functions, no flashinfer import).

FlashInfer's wrappers take a `backend=` ("fa2", "fa3", "auto", and in 0.7 "cudnn", "trtllm-gen",
"cute-dsl", ...). We name the kernel ourselves instead of passing "auto", so that a problem always
gets the same kernel on one machine and the choice is testable here:
- prefill: FA3 (Hopper warp-specialised, TMA) on sm90 for bf16/fp16 K/V and head sizes 64/128/256,
  without a custom mask (DCP-sharded prefill masks by global position, which FA3 does not take);
  FA2 elsewhere. FP8 K/V: FA2, because FlashInfer's FA3 FP8 kernel wants an FP8 query too (0.7.4
  `is_fa3_backend_supported`), and 0.5.3's FA3 over a bf16 query and an e4m3 cache failed to build.
  Not mirrored: 0.7.4's "auto" also drops to FA2 when every prefill row has <= 64 query tokens
  (FlashInfer measured that on an H20); a fixed wrapper per phase keeps one kernel per problem,
  and bench/attention_choice.py is where a short-chunk class would be measured.
- decode: FA2 (its CUDA-core kernel, or its tensor-core prefill kernel for GQA groups of 4+).
  "auto" in 0.7 may route float16 graph-mode decode to XQA MTP or, on sm100, to cuDNN, whose
  plans differ in what they freeze; FA2 behaves as 0.5.3 did.
- MLA decode: FA3 on sm90 (FlashInfer 0.7's auto order on Hopper too), FA2 elsewhere; never
  "auto", which on sm100 may pick trtllm-gen, whose cubins are downloaded at first use (no network
  on a serving box). FP8 (e4m3) latent caches need FlashInfer >= 0.7 and sm90.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

from meshserve.attention.backend import AttentionProblem

FA3_HEAD_SIZES = (64, 128, 256)  # FlashInfer's FA3 prefill instantiates these (equal QK and VO)


@cache
def flashinfer_version() -> tuple[int, int] | None:
    """(major, minor) of the installed flashinfer-python, None when it is not installed; read from
    the package metadata, so asking costs no `import flashinfer` (seconds, and a cache folder)."""
    try:
        text = version("flashinfer-python")
    except PackageNotFoundError:
        return None
    major, minor = (text.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def is_hopper(problem: AttentionProblem) -> bool:
    cc = problem.compute_capability
    return problem.device == "cuda" and cc is not None and cc[0] == 9


def prefill_kernel(problem: AttentionProblem) -> str:
    """FlashInfer's prefill kernel for `problem`: "fa3" or "fa2" (see the module docstring)."""
    spec = problem.spec
    fa3 = (
        is_hopper(problem)
        and not spec.kv_cache_dtype.is_fp8
        and problem.dcp_size == 1
        and spec.head_size == spec.v_size
        and spec.head_size in FA3_HEAD_SIZES
    )
    return "fa3" if fa3 else "fa2"


def decode_kernel(problem: AttentionProblem) -> str:
    """FlashInfer's decode kernel for `problem`: always "fa2" (see the module docstring)."""
    return "fa2"


def mla_decode_kernel(problem: AttentionProblem) -> str:
    """FlashInfer's MLA decode kernel for `problem`: "fa3" on sm90, else "fa2"."""
    return "fa3" if is_hopper(problem) else "fa2"
