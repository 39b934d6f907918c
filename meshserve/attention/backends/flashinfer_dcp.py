"""Host-side planning of FLASHINFER over a DCP-sharded cache (pure functions, no flashinfer import).

A DCP rank stores global positions rank, rank + dcp, ... at local slots 0, 1, ... FlashInfer
sees only the local slots: its page lists cover this rank's `local_len(seq_len)` tokens, and
its own masks (causal, window_left) compare *local* indices, which do not follow the global
positions the model's masks are defined by. So:
- decode rows without a sliding window need no mask (the query is the newest token: every key
  this rank holds is older) and run on the decode wrapper over local lengths;
- every other row (prefill and chunked-prefill rows; decode rows too when the model has a
  sliding window) runs on the prefill wrapper with a custom mask built here from global
  positions: key slot l is visible to the query at position qp when
  l * dcp + rank <= qp and (no window, or qp - (l * dcp + rank) < window).
The custom mask costs q_len x local_len bits per request; FlashInfer packs it on the device
(segment_packbits), which needs the page lists on the device too, so a masked plan reads them
back from the device once (a sync, in DCP prefill steps only).
A row that sees no key of this shard (or a request of which this rank holds no token) gets
output 0 and LSE -inf from the backend itself, whatever FlashInfer computes for it: FlashInfer
is given one key (the first slot of the request's first block) for an empty request, so its page
lists stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.core.arith import local_len


@dataclass(frozen=True)
class DcpMaskPlan:
    """Custom-mask planning for the rows that run on the prefill wrapper.

    kv_lens      per request, the local keys FlashInfer pages over (at least 1)
    custom_mask  [sum(q_len * kv_len)] bool, request by request, row-major [q_len, kv_len]
    empty_rows   indices (into these rows) of queries that see no key of this shard
    """

    kv_lens: tuple[int, ...]
    custom_mask: torch.Tensor
    empty_rows: tuple[int, ...]


def dcp_mask_plan(query_lens: Sequence[int], seq_lens: Sequence[int], *, dcp: int, rank: int,
                  window: int | None) -> DcpMaskPlan:
    """The prefill wrapper's custom mask for requests (query_lens, seq_lens) on DCP rank `rank`."""
    masks, kv_lens, empty, row0 = [], [], [], 0
    for q_len, seq_len in zip(query_lens, seq_lens):
        n = local_len(seq_len, dcp, rank)
        qp = torch.arange(seq_len - q_len, seq_len)[:, None]  # [q, 1] global query positions
        kp = (torch.arange(max(n, 1)) * dcp + rank)[None, :]  # [1, n] global key positions
        vis = (kp <= qp) & (torch.arange(max(n, 1)) < n)[None, :]
        if window is not None:
            vis &= (qp - kp) < window
        masks.append(vis.reshape(-1))
        kv_lens.append(max(n, 1))
        empty += [row0 + i for i in torch.nonzero(~vis.any(dim=1)).flatten().tolist()]
        row0 += q_len
    mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    return DcpMaskPlan(tuple(kv_lens), mask, tuple(empty))


def empty_decode_rows(seq_lens: Sequence[int], *, dcp: int, rank: int) -> tuple[int, ...]:
    """Decode rows (by index) of which this rank holds no token (short sequences, large dcp)."""
    return tuple(i for i, s in enumerate(seq_lens) if local_len(s, dcp, rank) == 0)
