"""Per-block lists as one packed bin each (a msgpack bin item): integers as little-endian uint32s,
block hashes concatenated. A 32k-token request lists 2048 block ids and 2048 hashes per KV layer
group: as msgpack items each is packed, unpacked and converted one by one (about 0.3 ms a hand-over
at 32k tokens); as one bin a group they are a copy, and split in C on the way back. Used by the KV
header (wire.py, since wire version 4) and the driver's HandoverBlocks (pins.py). numpy only: the
driver side imports it without torch."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 32  # a block hash (kvstore/block_hash.py: sha256)
_U32 = "I"  # array's C unsigned int: converts a list of ints in C, 4x faster than np.fromiter
if array(_U32).itemsize != 4:
    raise ImportError(f"meshserve needs a 4-byte C unsigned int (array typecode {_U32!r})")


def pack_u32(values: Sequence[int]) -> bytes:
    """`values` as packed little-endian uint32s; OverflowError or TypeError for an item that is not
    an integer in [0, 2**32)."""
    packed = array(_U32, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_u32(packed: object) -> tuple[int, ...]:
    """The integers of a pack_u32 bin; TypeError for anything else."""
    if type(packed) is not bytes or len(packed) % 4:
        raise TypeError(f"packed uint32s expected, got {type(packed).__name__}")
    return tuple(np.frombuffer(packed, dtype="<u4").tolist())


def pack_hashes(hashes: Sequence[bytes]) -> bytes:
    """Block hashes concatenated; ValueError unless each is HASH_BYTES bytes (a sender never packs
    another size, so the receiver splits by size)."""
    packed = b"".join(hashes)
    # none longer and HASH_BYTES each on average: each exactly HASH_BYTES (one pass, not a set of sizes)
    if len(packed) != HASH_BYTES * len(hashes) or max(map(len, hashes), default=0) > HASH_BYTES:
        raise ValueError(f"block hashes must be {HASH_BYTES} bytes each")
    return packed


def unpack_hashes(packed: object) -> tuple[bytes, ...]:
    """The hashes of a pack_hashes bin, HASH_BYTES each (split in C: a void dtype's items are
    bytes, trailing zero bytes kept); TypeError for anything else."""
    if type(packed) is not bytes or len(packed) % HASH_BYTES:
        raise TypeError(f"block hashes: {HASH_BYTES} bytes each, concatenated; got {type(packed).__name__}")
    return tuple(np.frombuffer(packed, dtype=f"V{HASH_BYTES}").tolist())
