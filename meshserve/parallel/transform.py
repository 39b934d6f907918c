"""Which attention heads a rank holds under tensor and decode-context parallelism.

Head bookkeeping (which KV heads a rank holds, with or without DCP) lives here and in
`local_attention_spec`, so the models' TP transforms (workers/models/transformer_parallel.py,
deepseek_parallel.py), the loader, the cache, the KV re-sharding and the backends agree.
"""

from __future__ import annotations

import dataclasses

from meshserve.attention.spec import AttentionSpec
from meshserve.errors import check
from meshserve.parallel.groups import ParallelContext


def local_kv_heads(num_kv_heads: int, tp: int, dcp: int = 1) -> int:
    """KV heads one rank stores: split over tp // dcp groups, one (replicated) when fewer heads.

    Under DCP the ranks of a DCP group hold the same KV heads and split their tokens instead.
    """
    groups = tp // dcp
    if num_kv_heads >= groups:
        check(num_kv_heads % groups == 0, "tp", tp,
              f"a value with num_key_value_heads={num_kv_heads} divisible by tp/dcp={groups}")
        return num_kv_heads // groups
    check(groups % num_kv_heads == 0, "tp", tp,
          f"a value with tp/dcp={groups} a multiple of num_key_value_heads={num_kv_heads}")
    return 1


def kv_head_offset(num_kv_heads: int, tp: int, dcp: int, rank: int) -> int:
    """The first KV head rank `rank` stores."""
    groups, group = tp // dcp, rank // dcp
    if num_kv_heads >= groups:
        return group * (num_kv_heads // groups)
    return group * num_kv_heads // groups


def local_attention_spec(spec: AttentionSpec, ctx: ParallelContext) -> AttentionSpec:
    """The layer as this rank's backend sees it: under DCP, the query heads of the whole DCP
    group (they are gathered before attention) over this rank's KV heads."""
    check(spec.num_heads % ctx.tp == 0, "tp", ctx.tp, f"a divisor of num_heads={spec.num_heads}")
    return dataclasses.replace(spec, num_heads=spec.num_heads // ctx.tp * ctx.dcp,
                               num_kv_heads=local_kv_heads(spec.num_kv_heads, ctx.tp, ctx.dcp))
