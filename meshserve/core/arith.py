"""Integer arithmetic every layer shares: ceiling division and the DCP interleaved length.

Both work on Python ints and element-wise on integer torch tensors and numpy arrays (`//` floors
on all three), so the host planners and the batched tensor paths read the same formula.
"""

from __future__ import annotations

from typing import TypeVar

N = TypeVar("N")  # int, or an integer tensor / array


def cdiv(a: N, b: int) -> N:
    """ceil(a / b) for b > 0: how many blocks of b hold a items."""
    return -(-a // b)  # type: ignore[operator]


def local_len(seq_len: N, dcp_size: int, dcp_rank: int) -> N:
    """How many of positions [0, seq_len) DCP rank `dcp_rank` of `dcp_size` stores.

    Position p lives on rank p % dcp_size (at local row p // dcp_size), so rank r holds the
    positions r, r + dcp_size, ... below seq_len. Needs 0 <= dcp_rank < dcp_size and seq_len >= 0.
    """
    return cdiv(seq_len - dcp_rank, dcp_size)  # type: ignore[operator]
