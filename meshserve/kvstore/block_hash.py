"""Content hashes of full KV blocks, chained so that a hash names a whole prefix.

hash(block i) = sha256(hash(block i-1) | token ids of block i as int64 | extra keys), with the
root parent a fixed 32-byte string. Equal hashes therefore mean equal prefixes (not just equal
blocks), which is what lets two requests share the blocks.

Why sha256 and not Python's `hash`: the digest is the same in every process and on every host,
so a coordinator can route by prefix and a replica that imports KV can register the sender's
hashes; and a collision (which would hand one request another's KV) is not something a client
can provoke. Cost is about 1 µs per block, paid once per full block.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from hashlib import sha256

import msgpack

from meshserve.errors import ConfigError

BlockHash = bytes  # 32-byte sha256 digest
ROOT_HASH: BlockHash = b"meshserve-kv-root".ljust(32, b"\0")


def encode_extra_keys(extra_keys: Sequence[object]) -> bytes:
    """Canonical bytes of a request's extra keys (LoRA name, cache salt, multimodal ids ...).

    Extra keys are part of every block hash of the request, so requests with different keys
    never share blocks even when their tokens agree. Allowed items: str, int, bytes, and
    tuples/lists of those.
    """
    if not extra_keys:
        return b""
    try:
        return msgpack.packb(list(extra_keys), use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError("extra_keys", extra_keys, "a sequence of str, int or bytes items") from exc


def group_salt(group: int) -> bytes:
    """Appended to the encoded extra keys of KV layer group `group`, so equal prefixes of two
    groups (which hold different layers' KV) never map to one block. Group 0 has none (a
    one-group model hashes as if there were no groups); 0xc1 never starts a msgpack object, so a
    salted key string never equals another request's unsalted one."""
    return b"" if group == 0 else b"\xc1" + group.to_bytes(2, "little")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block).

    token_ids: the block's tokens (exactly tokens_per_block of them; not checked here), hashed
    as little-endian int64 so every host agrees. extra: `encode_extra_keys(...)` of the request.
    """
    packer = _PACKERS.get(len(token_ids))
    if packer is None:
        packer = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q").pack
    return sha256((parent or ROOT_HASH) + packer(*token_ids) + extra).digest()


_PACKERS: dict[int, Callable[..., bytes]] = {}


def hash_blocks(
    token_ids: Sequence[int],
    tokens_per_block: int,
    *,
    extra: bytes = b"",
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (default: all full ones)."""
    full = len(token_ids) // tokens_per_block
    count = full if num_blocks is None else min(num_blocks, full)
    out: list[BlockHash] = []
    parent = None
    for i in range(count):
        parent = hash_block(parent, token_ids[i * tokens_per_block : (i + 1) * tokens_per_block], extra)
        out.append(parent)
    return out
