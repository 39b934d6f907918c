"""Tile shapes and launch settings of the Triton attention kernels, per device and head size.

The CUDA values were chosen by measurement on an H200 (bench/attention.py, docs/performance.md).
On the CPU interpreter small tiles keep several tiles per sequence in the tests' short
sequences, so the masked and unmasked paths, the window edges and the splits all run.
This module imports no Triton: the backend reads it to plan without loading kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.errors import check


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # K/V pages through tensor descriptors (TMA) instead of pointer gathers (kernels/kv_pages.py);
    # used where the cache allows it (sm_90+, contiguous, aligned), else the gather path runs.
    kv_desc: bool = False
    # A prefill sequence with no cached context (first query at position 0) reads its keys from
    # the step's own contiguous K/V (the `key`/`value` given to forward) instead of the pages it
    # was just written to: one descriptor load per tile at any page size with kv_desc
    # (kernels/kv_rows.py). 16-bit caches without DCP only (TritonBackend.fresh_kv_reasons).
    # On CUDA such sequences get tiles of their own by default (fresh_prefill_config).
    fresh_kv: bool = False
    max_registers: int | None = None  # per thread (Triton's maxnreg): trades spills for occupancy
    # The fresh tiles through the Gluon kernel for Hopper (kernels/prefill_gluon.py: a TMA loader
    # warp, two consumer warpgroups, asynchronous wgmma) where TritonBackend.gluon_prefill_reasons
    # are empty; elsewhere they run the portable kernel with this config's tiles. Needs fresh_kv and
    # block_m == 128 (two warpgroups of 64 queries); num_stages is its K/V ring's depth (2 or 3). The
    # default for fresh prompts on sm_90 where it serves the problem (GLUON_FRESH_CONFIG;
    # TritonBackend.gluon_prefill_reasons).
    gluon: bool = False
    # With gluon: the next key tile's Q K^T issued before this tile's softmax (FA3's intra-warpgroup
    # overlap; H100: 1.06-1.09x one tile at a time) rather than one tile at a time.
    gluon_overlap: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            n = getattr(self, name)
            check(n >= 16 and n & (n - 1) == 0, name, n, "a power of two >= 16 (a tl.dot tile side)")
        check(self.num_warps in (1, 2, 4, 8, 16), "num_warps", self.num_warps, "1, 2, 4, 8 or 16")
        check(self.num_stages >= 1, "num_stages", self.num_stages, "an integer >= 1")
        regs = self.max_registers
        check(regs is None or 24 <= regs <= 255, "max_registers", regs, "None or 24..255 registers per thread")
        if self.gluon:
            check(self.fresh_kv, "gluon", self.gluon, "False unless fresh_kv=True (it serves fresh sequences only)")
            check(self.block_m == 128, "block_m", self.block_m, "128 with gluon=True (two warpgroups of 64 queries)")
            # the Gluon kernel's K/V ring (kernels/prefill_gluon.py MAX_STAGES: shared memory at head 128)
            check(self.num_stages in (2, 3), "num_stages", self.num_stages, "2 or 3 with gluon=True (its K/V ring)")


# The descriptor K/V path (TMA) in the CUDA defaults: from this page size on, one page holds a
# whole 64-key tile, so a tile is one descriptor load. H200 sweep (bench/prefill_sweep.py,
# docs/performance.md): at pages of 64 it beats the gather path by 1.19-1.34x (410 against 324
# TFLOP/s at 4 x 4096, 468 against 378 at 1 x 16384); at pages of 16 (four loads per tile) it
# is 3-4x slower, so smaller pages keep the gather path.
PREFILL_DESCRIPTOR_MIN_PAGE = 64


def _descriptor_tiles(block_d: int, dtype: str, kv_fp8: bool, page: int | None,
                      compute_capability: tuple[int, int] | None) -> PrefillConfig | None:
    """The measured descriptor tiles where they apply (Hopper or later, 16-bit, head <= 128, whole
    pages per tile), else None. FP8 caches were not measured on this path: they keep the gather."""
    if page is None or page < PREFILL_DESCRIPTOR_MIN_PAGE or kv_fp8 or block_d > 128:
        return None
    if dtype not in ("bfloat16", "float16") or compute_capability is None or compute_capability < (9, 0):
        return None
    return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, kv_desc=True)


# Fresh bf16 prompts on sm_90 where the Gluon kernel serves the problem (kernels/prefill_gluon.py). H100,
# 2026-12-06 (bench/prefill_sweep.py, bf16, GQA 32/8 x 128, docs/performance.md): 555 / 606 TFLOP/s at
# 4 x 4096 / 1 x 16384 against 468 / 485 for fresh_prefill_config's 64 x 64 tiles (1.19x / 1.25x), and
# 0.85x / 0.87x FlashInfer 0.7's ragged prefill. The tiles are the portable kernel's where Gluon cannot
# take a step's tensors (unaligned rows): 128 x 64 at 2 stages, which fit one CTA per SM.
GLUON_FRESH_CONFIG = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, kv_desc=True, fresh_kv=True,
                                   gluon=True)  # fmt: skip


def fresh_prefill_config(head_size: int, dtype: str, device: str, kv_fp8: bool,
                         compute_capability: tuple[int, int] | None) -> PrefillConfig | None:
    """Tiles for the prefill sequences with no cached context, which read the step's own K/V
    through row descriptors (kernels/kv_rows.py), or None: they read the pages like the rest.

    H100 sweep (bench/prefill_sweep.py, 2026-12-06, bf16, GQA 32/8 x 128, docs/performance.md):
    64 x 64 tiles, 4 warps, 3 stages (no spills, two CTAs per SM) ran 459 / 472 TFLOP/s at
    4 x 4096 / 1 x 16384, against 324 / 343 for the gather tiles that pages of 16 get and 413 /
    441 for page descriptors at pages of 64; 128 x 64 at 3 stages fits one CTA per SM (322 /
    353), at 2 stages 433 / 490. Hopper or later, 16-bit, head <= 128, as the descriptor tiles."""
    block_d = max(16, 1 << (head_size - 1).bit_length())
    if device != "cuda" or dtype not in ("bfloat16", "float16") or kv_fp8 or block_d > 128:
        return None
    if compute_capability is None or compute_capability < (9, 0):
        return None
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, kv_desc=True, fresh_kv=True)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int
    min_partition: int  # fewest keys per split worth a merge pass
    programs_per_sm: int = 8  # splits are added until the grid has about this many programs per SM


def default_prefill_config(head_size: int, dtype: str, device: str, kv_fp8: bool, *, page: int | None = None,
                           compute_capability: tuple[int, int] | None = None) -> PrefillConfig:
    """page: the cache's block size (None: unknown, no descriptor path)."""
    if device != "cuda":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    block_d = max(16, 1 << (head_size - 1).bit_length())
    if dtype == "float32":  # IEEE fp32 products run on FMA units; these tiles spill least
        return PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
    desc = _descriptor_tiles(block_d, dtype, kv_fp8, page, compute_capability)
    if desc is not None:
        return desc
    if block_d <= 128:  # H200 sweep: one warpgroup per 128 queries beat two (docs/performance.md)
        return PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


# From this many queries in one sequence on, long_prefill_config's tiles replace the default ones.
LONG_PREFILL_QUERIES = 8192


def long_prefill_config(
    head_size: int, dtype: str, device: str, kv_fp8: bool, compute_capability: tuple[int, int] | None, *,
    page: int | None = None,
) -> PrefillConfig | None:
    """Tiles for steps whose longest prefill has >= LONG_PREFILL_QUERIES queries, or None (the default).

    Two warpgroups of 128 queries each share every K/V tile: H200, bf16, head 128, causal
    (docs/performance.md): 380 against 353 TFLOP/s at 1 x 16384, 325 against 320 at 4 x 4096.
    Hopper and later only: measured there, and the tiles take 128 KB of shared memory (more than
    sm_89 GPUs give; untried on sm_80). None too where the default tiles read K/V through
    descriptors (pages >= PREFILL_DESCRIPTOR_MIN_PAGE): those beat these tiles at 1 x 16384.
    """
    block_d = max(16, 1 << (head_size - 1).bit_length())
    if device != "cuda" or dtype not in ("bfloat16", "float16") or kv_fp8 or block_d > 128:
        return None
    if compute_capability is None or compute_capability < (9, 0):
        return None
    if _descriptor_tiles(block_d, dtype, kv_fp8, page, compute_capability) is not None:
        return None
    return PrefillConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)


def default_decode_config(head_size: int, dtype: str, device: str, kv_fp8: bool) -> DecodeConfig:
    if device != "cuda":
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1, min_partition=32, programs_per_sm=2)
    block_d = max(16, 1 << (head_size - 1).bit_length())
    if dtype == "float32":
        return DecodeConfig(block_n=32, num_warps=8, num_stages=2, min_partition=512)
    if block_d > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2, min_partition=512)
    if kv_fp8:  # half the bytes per key: twice the keys per tile (H200 sweep, docs/performance.md)
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, min_partition=512)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=512)
