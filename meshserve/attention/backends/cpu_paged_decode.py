"""A paged decode-attention kernel for CPU_SDPA, in C++ compiled on first use.

A CPU decode step's attention is memory-bound: on the demo model at 64 sequences x 128 keys,
the torch ops (K gather, score matmul, `embedding_bag` over V per query head) move about 21 MB
per layer where one pass over K and V is 8.4 MB (docs/performance.md). This kernel walks each
sequence's block table and reads every K row and every V row of the cache once, in place:
per sequence, the scores of all query heads against each K row (the query heads of one KV head
share the row), a softmax per head (with soft-cap and learned sinks), then each V row added into
every query head's output. It returns the LSE too, so the DCP merge works through it. Head sizes
64 and 128 take a faster path (`sequence_fast`): 16 keys per query head at a time with one
transposing reduction, V summed into outputs held in registers (1.9x warm, 1.5x cold at 64
sequences on the Zen-4-class host: docs/performance.md); its sums run in another order, within
float32 rounding of the per-key loop.

Source: cpu_paged_decode.cpp, built with the decoder layer's fused ops into one module
(cpu_extension.py) when the first float32 CPU_SDPA backend is made; when it cannot be built,
CPU_SDPA runs its torch path. The vector helpers at its top (v16, load16, store16, hsum, exp16)
serve cpu_step_ops.cpp too, which follows it in the module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshserve.attention.backends.cpu_extension import cpu_extension

PagedDecodeOp = Callable[..., list[torch.Tensor]]


def paged_decode_op() -> PagedDecodeOp | None:
    """The compiled `paged_decode(query, cache, table, kv_lens, scale, soft_cap, sinks) -> [out,
    lse]` of meshserve's CPU module (cpu_extension.py: built on the first call of the process,
    or loaded from its cache directory); None when it is turned off or cannot be built."""
    module = cpu_extension()
    return None if module is None else module.paged_decode


__all__ = ["paged_decode_op"]
