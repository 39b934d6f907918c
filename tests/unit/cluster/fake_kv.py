"""A small, obviously-correct KVBlocks for scheduler tests (no eviction order, no copy-on-write).

Full blocks are cached by their whole token prefix; a cached block with no user stays
reusable until the pool needs it.
"""

from collections.abc import Sequence


class FakeKV:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[tuple[int, ...], int] = {}  # token prefix -> block
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.pending: dict[str, list[int]] = {}
        self.num_blocks = num_blocks

    @property
    def num_free_blocks(self) -> int:
        return sum(1 for r in self.refs if r == 0)

    def lookup_prefix(self, rid: str, tokens: Sequence[int]) -> int:
        hits = []
        if self.prefix_caching:
            bs = self.block_size
            for i in range((len(tokens) - 1) // bs):  # keep at least one token to compute
                block = self.cached.get(tuple(tokens[: (i + 1) * bs]))
                if block is None:
                    break
                hits.append(block)
        self.pending[rid] = hits
        return len(hits) * self.block_size

    def _take(self) -> int:
        unused = [b for b in range(self.num_blocks) if self.refs[b] == 0]
        fresh = [b for b in unused if b not in self.prefix_of]
        if fresh:
            return fresh[0]
        b = unused[0]  # evict a cached block nobody uses
        del self.cached[self.prefix_of.pop(b)]
        return b

    def allocate(self, rid: str, tokens: Sequence[int], num_computed: int, num_new: int) -> bool:
        table = self.tables.get(rid) or list(self.pending.pop(rid, []))
        need = -(-(num_computed + num_new) // self.block_size) - len(table)
        free_now = sum(1 for b in range(self.num_blocks) if self.refs[b] == 0 and b not in table)
        if need > free_now:
            return False
        for b in table if rid not in self.tables else []:
            self.refs[b] += 1
        for _ in range(need):
            b = self._take()
            self.refs[b] = 1
            table.append(b)
        self.tables[rid] = table
        return True

    def computed(self, rid: str, tokens: Sequence[int], num_computed: int) -> None:
        if not self.prefix_caching:
            return
        for i in range(num_computed // self.block_size):
            key = tuple(tokens[: (i + 1) * self.block_size])
            block = self.tables[rid][i]
            if key not in self.cached and block not in self.prefix_of:
                self.cached[key] = block
                self.prefix_of[block] = key

    def free(self, rid: str) -> None:
        self.pending.pop(rid, None)
        for b in self.tables.pop(rid, []):
            self.refs[b] -= 1

    def block_ids(self, rid: str) -> list[int]:
        return list(self.tables[rid])
