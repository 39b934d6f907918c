"""Which cached tokens a request still needs: full attention, sliding window, StreamingLLM sinks.

Masking (see AttentionSpec): a query at position q sees key k iff k <= q and (no window, or
q - k < window, or k < num_sink_tokens). Queries only move forward, so once the next query
position is n, keys below n - window + 1 that are not sinks are never read again, and a block
whose every position is such a key can go back to the pool.

Each KV layer group (kvstore/groups.py) has one policy: its layers' window and sinks. Layers of
different kinds that share one block table (one group, when their page shapes differ) can give
a block back only when *no* layer needs it. Each layer needs the block set [0, sink_blocks) ∪
[first_window_block, ∞); the union of such sets is again of that form, with the largest sink
count and the largest window (a full-attention layer: keep everything), so one `RetentionPolicy`
describes such a group too; `from_specs` builds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshserve.attention.spec import AttentionSpec, AttentionType, check_window
from meshserve.core.arith import cdiv


@dataclass(frozen=True)
class RetentionPolicy:
    """Which positions the cache must keep.

    sliding_window: the attention window in tokens (the query itself counts); None keeps all.
    num_sink_tokens: StreamingLLM sinks, the first tokens, kept forever beside the window.
    """

    sliding_window: int | None = None
    num_sink_tokens: int = 0

    def __post_init__(self) -> None:
        check_window(self.sliding_window, self.num_sink_tokens)

    @classmethod
    def from_specs(cls, specs: Iterable[AttentionSpec]) -> RetentionPolicy:
        """The policy that keeps what every cached layer of the model needs (see module doc)."""
        windows: list[int] = []
        sinks = 0
        any_cached = False
        for spec in specs:
            if not spec.uses_kv_cache:
                continue
            any_cached = True
            if spec.sliding_window is None or spec.attn_type is not AttentionType.DECODER:
                return cls()  # a full-attention (or encoder/cross) layer reads every position
            windows.append(spec.sliding_window)
            sinks = max(sinks, spec.num_sink_tokens)
        if not any_cached:
            return cls()
        return cls(sliding_window=max(windows), num_sink_tokens=sinks)

    @property
    def keeps_everything(self) -> bool:
        return self.sliding_window is None

    def num_sink_blocks(self, tokens_per_block: int) -> int:
        """Blocks holding at least one sink token: never released."""
        return cdiv(self.num_sink_tokens, tokens_per_block)

    def first_needed_position(self, next_query_position: int) -> int:
        """Smallest non-sink key position any query at >= `next_query_position` can see."""
        if self.sliding_window is None:
            return 0
        return max(0, next_query_position - self.sliding_window + 1)

    def first_needed_block(self, next_query_position: int, tokens_per_block: int) -> int:
        """Blocks in [num_sink_blocks, this) are no longer needed by any future query."""
        return self.first_needed_position(next_query_position) // tokens_per_block

    def needed_blocks(self, next_query_position: int, num_blocks: int, tokens_per_block: int) -> list[bool]:
        """For a table of `num_blocks` blocks, which ones queries at >= the position still read."""
        lo = self.first_needed_block(next_query_position, tokens_per_block)
        sink = self.num_sink_blocks(tokens_per_block)
        return [i < sink or i >= lo for i in range(num_blocks)]
