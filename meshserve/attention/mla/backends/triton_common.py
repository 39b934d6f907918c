"""What the TRITON MLA decode and prefill backends share: capabilities, limits and tile shapes.

The CUDA tile shapes were chosen by measurement on an H200 (bench/attention_mla.py,
docs/performance.md). On the CPU interpreter small tiles make the tests' short sequences span
several tiles, splits and pages, so every path runs. This module imports no Triton.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass

from meshserve.attention.backend import AttentionProblem, BackendCapabilities
from meshserve.attention.spec import AttentionType, KVCacheDtype
from meshserve.errors import check

TRITON_MLA_CAPABILITIES = BackendCapabilities(
    dtypes=frozenset({"float32", "float16", "bfloat16"}),
    kv_cache_dtypes=frozenset(KVCacheDtype),
    min_block_size=1,
    max_block_size=1024,
    naive_layout=True,
    paged_layout=True,
    min_head_size=1,
    max_head_size=1024,
    head_size_multiple=1,
    attention_types=frozenset({AttentionType.DECODER}),
    sliding_window=False,
    learned_sinks=False,
    sink_tokens=False,
    alibi=False,
    soft_cap=False,
    mla=True,
    returns_lse=True,
    dcp=True,
    devices=frozenset({"cuda", "cpu"}),
    min_compute_capability=(8, 0),
    required_packages=("triton",),
)


def with_notes(notes: str, **changes: object) -> BackendCapabilities:
    return dataclasses.replace(TRITON_MLA_CAPABILITIES, notes=notes, **changes)


def triton_reasons(problem: AttentionProblem) -> list[str]:
    """Limits of the Triton MLA kernels that the capability record cannot express."""
    out = []
    if problem.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            out.append("on CPU the Triton kernels run only in the interpreter (TRITON_INTERPRET=1)")
        if problem.dtype == "bfloat16":
            out.append("dtype 'bfloat16' on CPU: the Triton interpreter computes bf16 arithmetic wrongly")
    cc = problem.compute_capability
    if problem.device == "cuda" and problem.spec.kv_cache_dtype.is_fp8 and cc is not None and cc < (8, 9):
        out.append(f"an FP8 KV cache needs compute capability >= 8.9 (have {cc[0]}.{cc[1]})")
    return out


class MLADecodeKernel(enum.StrEnum):
    """Which Triton kernel the TRITON MLA decode backend launches (a str: configs dump to JSON)."""

    SHARED_ROWS = "shared_rows"  # kernels/mla_decode.py: the default, measured (docs/performance.md)
    FLASHMLA = "flashmla"  # kernels/mla_decode_fm.py: FlashMLA's cut (64-key tiles, split columns); sm_90 default


@dataclass(frozen=True)
class MLADecodeConfig:
    block_h: int  # heads per program (rows of both dot products)
    block_n: int  # cache rows per tile
    num_warps: int
    num_stages: int
    programs_per_sm: int  # the split heuristic aims at num_sms * programs_per_sm programs
    min_partition: int  # fewest keys per split worth a merge pass
    kernel: MLADecodeKernel = MLADecodeKernel.SHARED_ROWS
    value_split: int = 1  # FLASHMLA only: programs that split the output columns of one head block (1 or 2)
    prefetch: bool = False  # FLASHMLA only: load the next tile into registers one tile ahead (with num_stages 1)

    def __post_init__(self) -> None:
        check(self.value_split in (1, 2), "value_split", self.value_split, "1 or 2")
        check(self.value_split == 1 or self.kernel is MLADecodeKernel.FLASHMLA, "value_split", self.value_split,
              "1 unless kernel is MLADecodeKernel.FLASHMLA (the shared-rows kernel keeps every column)")
        check(not self.prefetch or self.kernel is MLADecodeKernel.FLASHMLA, "prefetch", self.prefetch,
              "False unless kernel is MLADecodeKernel.FLASHMLA")


@dataclass(frozen=True)
class MLAPrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(num_heads: int, dtype: str, device: str) -> MLADecodeConfig:
    if device != "cuda":
        return MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, programs_per_sm=1,
                               min_partition=32)  # fmt: skip
    if dtype == "float32":
        return MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, programs_per_sm=2,
                               min_partition=256)  # fmt: skip
    # Measured on an H200 (bench/attention_mla.py, docs/performance.md): 64 heads share each row
    # load (wgmma needs 64 rows); their 64 x 512 fp32 accumulators fill the register file at 8
    # warps, which leaves room for 32-row tiles, not 64.
    block_h = 64 if num_heads >= 64 else max(16, 1 << (num_heads - 1).bit_length())
    return MLADecodeConfig(block_h=block_h, block_n=32, num_warps=8, num_stages=2, programs_per_sm=2,
                           min_partition=256)  # fmt: skip


def flashmla_decode_config(num_heads: int, dtype: str, device: str, *, value_split: int = 1,
                           block_n: int | None = None, num_stages: int = 3, prefetch: bool = False) -> MLADecodeConfig:
    """The FlashMLA-structured decode kernel (kernels/mla_decode_fm.py) with these tiles;
    bench/mla_decode_device.py times its variants against the shared-rows kernel and FlashInfer
    (measured_decode_config picks the default). On the GPU 64 heads x 32-key tiles at 8 warps
    and 3 stages unless told: the shared-rows kernel's tiles with the copies really two tiles
    deep. value_split 2: two programs keep 256 output columns each and both compute the scores;
    prefetch: the next tile through registers."""
    base = decode_config(num_heads, dtype, device)
    if block_n is None:
        block_n = base.block_n if device != "cuda" or dtype == "float32" else 32
    return dataclasses.replace(base, kernel=MLADecodeKernel.FLASHMLA, value_split=value_split, block_n=block_n,
                               num_stages=num_stages if device == "cuda" else base.num_stages, prefetch=prefetch)


def measured_decode_config(num_heads: int, dtype: str, device: str, kv_fp8: bool,
                           compute_capability: tuple[int, int] | None) -> MLADecodeConfig:
    """The TRITON MLA decode default: where it was measured (CUDA sm_90+, 16-bit latents, 64 heads
    or more), the FlashMLA-structured kernel with one head block of 64 x [64-key tiles], 8 warps,
    2 stages: on an H100 (bench/mla_decode_device.py, 2026-12-06, 128 heads, latent 512 + 64,
    pages of 64) 1.30-1.62x the shared-rows kernel at 64 x 4k, 128 x 2k, 32 x 8k and 8 x 32k
    (347 / 366 / 389 / 339 against 458 / 476 / 518 / 549 µs), the fastest of the eleven variants
    timed at every shape. Elsewhere (FP8 latents, fewer heads, other GPUs: not measured) decode_config."""
    hopper = compute_capability is not None and compute_capability >= (9, 0)
    if device == "cuda" and hopper and dtype in ("bfloat16", "float16") and not kv_fp8 and num_heads >= 64:
        return flashmla_decode_config(num_heads, dtype, device, block_n=64, num_stages=2)
    return decode_config(num_heads, dtype, device)


def prefill_config(dtype: str, device: str) -> MLAPrefillConfig:
    if device != "cuda":
        return MLAPrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if dtype == "float32":
        return MLAPrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    return MLAPrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << (max(n, 1) - 1).bit_length())
