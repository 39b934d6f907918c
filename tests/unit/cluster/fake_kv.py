"""Temporary stand-in with KVCacheManager's interface (until the kvstore branch is merged)."""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Hit:
    num_tokens: int
    block_ids: tuple[int, ...]


class FakeKV:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.refs[0] = 1 << 30  # the null block
        self.tables: dict[str, list[int]] = {}
        self.ntok: dict[str, int] = {}
        self.cached: dict[tuple[int, ...], int] = {}
        self.prefix_of: dict[int, tuple[int, ...]] = {}

    @property
    def num_free_blocks(self) -> int:
        return sum(1 for r in self.refs if r == 0)

    def lookup_prefix(self, tokens: Sequence[int]) -> Hit:
        hits = []
        if self.prefix_caching:
            bs = self.block_size
            for i in range((len(tokens) - 1) // bs):
                block = self.cached.get(tuple(tokens[: (i + 1) * bs]))
                if block is None:
                    break
                hits.append(block)
        return Hit(len(hits) * self.block_size, tuple(hits))

    def _take(self) -> int:
        unused = [b for b in range(self.num_blocks) if self.refs[b] == 0]
        fresh = [b for b in unused if b not in self.prefix_of]
        if fresh:
            return fresh[0]
        b = unused[0]
        del self.cached[self.prefix_of.pop(b)]
        return b

    def allocate_slots(self, rid: str, n: int, tokens: Sequence[int], *, prefix: Hit | None = None) -> bool:
        table = self.tables.get(rid)
        start = self.ntok.get(rid, 0)
        if table is None:
            table = list(prefix.block_ids) if prefix else []
            start = prefix.num_tokens if prefix else 0
        need = -(-(start + n) // self.block_size) - len(table)
        if need > sum(1 for b in range(self.num_blocks) if self.refs[b] == 0 and b not in table):
            return False
        if rid not in self.tables:
            for b in table:
                self.refs[b] += 1
        for _ in range(need):
            b = self._take()
            self.refs[b] = 1
            table.append(b)
        self.tables[rid], self.ntok[rid] = table, start + n
        if self.prefix_caching:
            for i in range(min(start + n, len(tokens)) // self.block_size):
                key = tuple(tokens[: (i + 1) * self.block_size])
                if key not in self.cached and table[i] not in self.prefix_of:
                    self.cached[key], self.prefix_of[table[i]] = table[i], key
        return True

    def free(self, rid: str) -> None:
        self.ntok.pop(rid, None)
        for b in self.tables.pop(rid, []):
            self.refs[b] -= 1

    def block_table(self, rid: str) -> list[int]:
        return self.tables[rid]

    def take_copies(self) -> list:
        return []
