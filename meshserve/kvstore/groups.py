"""Which layers share a block table: the KV cache group layout of a model (plain Python).

Most models have one group: every layer keeps the same positions, so one block table per
request serves all of them (a block id indexes dim 0 of every layer's cache tensor).

A hybrid model (Gemma-2/3, GPT-OSS: sliding-window and full-attention layers) keeps different
positions in different layers. When all its cached layers have the same page shape (KV heads,
head size, cache dtype), the layers are split into groups of equal size G, each group of one
retention (window and sinks), and every group gets its own block table per request; windowed
groups then release the blocks that left their window. Slot j of every group shares ONE cache
tensor (`layer_slots`), so block id b of group A and block id b of group B are the same memory:
the groups draw their ids from one shared BlockPool and never hold the same id at once. The
cache is G tensors of num_blocks pages instead of num_layers tensors, so the same memory holds
num_layers / G times as many block ids (docs/kvstore.md).

Models whose layer kinds differ in page shape keep one group with the union retention (every
block stays while any layer needs it), as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

from meshserve.attention.spec import AttentionSpec, AttentionType
from meshserve.errors import check
from meshserve.kvstore.retention import RetentionPolicy


def layer_retention(spec: AttentionSpec) -> RetentionPolicy:
    """What one cached layer must keep: its window and sinks, or everything."""
    if spec.sliding_window is None or spec.attn_type is not AttentionType.DECODER:
        return RetentionPolicy()
    return RetentionPolicy(spec.sliding_window, spec.num_sink_tokens)


def _page_kind(spec: AttentionSpec) -> tuple:
    """Layers with equal kinds can store their pages in one tensor (the tp split is uniform)."""
    return (spec.mla, spec.num_kv_heads, max(spec.head_size, spec.v_size), spec.kv_cache_dtype)


@dataclass(frozen=True)
class KVGroupLayout:
    """groups: per group, the model layer indices it holds (slot order); retentions: per group.

    Layers that keep no cache (encoder-only) belong to no group.
    """

    groups: tuple[tuple[int, ...], ...]
    retentions: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        check(len(self.groups) == len(self.retentions) >= 1, "groups", len(self.groups),
              f"one group per retention ({len(self.retentions)}), at least one")
        sizes = {len(g) for g in self.groups}
        check(len(sizes) == 1, "groups", sorted(sizes), "groups of equal size (slot j shares one tensor)")

    @classmethod
    def from_specs(cls, specs: Sequence[AttentionSpec]) -> KVGroupLayout:
        """One group per G layers of one retention when the model is hybrid and all its cached
        layers share a page shape; otherwise one group with the union retention."""
        cached = [i for i, s in enumerate(specs) if s.uses_kv_cache]
        kinds: dict[RetentionPolicy, list[int]] = {}
        for i in cached:
            kinds.setdefault(layer_retention(specs[i]), []).append(i)
        pages = {_page_kind(specs[i]) for i in cached}
        if len(kinds) <= 1 or len(pages) > 1:
            return cls((tuple(cached),), (RetentionPolicy.from_specs(specs),))
        size = 0
        for layers in kinds.values():
            size = gcd(size, len(layers))
        groups, retentions = [], []
        for retention, layers in kinds.items():
            for start in range(0, len(layers), size):
                groups.append(tuple(layers[start : start + size]))
                retentions.append(retention)
        return cls(tuple(groups), tuple(retentions))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def num_slots(self) -> int:
        """Cache tensors the layout allocates (layers per group; one group: one per cached layer)."""
        return len(self.groups[0])

    def group_of_layer(self, num_layers: int) -> list[int]:
        """Per model layer, its group (0 for layers without a cache: their metadata is unused)."""
        out = [0] * num_layers
        for g, layers in enumerate(self.groups):
            for i in layers:
                out[i] = g
        return out

    def layer_slots(self, num_layers: int) -> list[int | None]:
        """Per model layer, the cache tensor it lives in: slot j of every group shares one (with
        one group every cached layer has its own); None for layers without a cache."""
        out: list[int | None] = [None] * num_layers
        for layers in self.groups:
            for slot, i in enumerate(layers):
                out[i] = slot
        return out

    def to_wire(self) -> list:
        return [[list(g), [r.sliding_window, r.num_sink_tokens]] for g, r in zip(self.groups, self.retentions)]

    @classmethod
    def from_wire(cls, obj: Sequence) -> KVGroupLayout:
        groups = tuple(tuple(int(i) for i in g) for g, _ in obj)
        retentions = tuple(RetentionPolicy(None if w is None else int(w), int(s)) for _, (w, s) in obj)
        return cls(groups, retentions)
