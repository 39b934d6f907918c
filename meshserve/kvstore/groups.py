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

An encoder-decoder model's cross-attention layers form their own group (`encoder_group`): their
table covers the encoder input, filled once in the request's first step and never grown, so the
scheduler allocates it apart from the decoder groups' tables (from the same pool) and frees it
with the request. Their attention metadata is the decoder group 0's, which carries the encoder
tables beside the decoder ones (AttentionMetadata.encoder_block_table).
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

    Layers that keep no cache (encoder-only) belong to no group. encoder_group: the index of the
    cross-attention layers' group (the last one), or None.
    """

    groups: tuple[tuple[int, ...], ...]
    retentions: tuple[RetentionPolicy, ...]
    encoder_group: int | None = None

    def __post_init__(self) -> None:
        check(len(self.groups) == len(self.retentions) >= 1, "groups", len(self.groups),
              f"one group per retention ({len(self.retentions)}), at least one")
        sizes = {len(g) for g in self.groups}
        check(len(sizes) == 1, "groups", sorted(sizes), "groups of equal size (slot j shares one tensor)")
        check(self.encoder_group in (None, len(self.groups) - 1) and len(self.groups) >= 1 + (
              self.encoder_group is not None), "encoder_group", self.encoder_group,
              f"None or the last group ({len(self.groups) - 1}) after at least one decoder group")

    @classmethod
    def from_specs(cls, specs: Sequence[AttentionSpec]) -> KVGroupLayout:
        """One group per G layers of one retention when the model is hybrid and all its cached
        layers share a page shape; otherwise one group with the union retention."""
        cross = [i for i, s in enumerate(specs) if s.attn_type is AttentionType.CROSS]
        if cross:
            return cls._encoder_decoder(specs, cross)
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

    @classmethod
    def _encoder_decoder(cls, specs: Sequence[AttentionSpec], cross: list[int]) -> KVGroupLayout:
        """Decoder self-attention layers in group 0, cross-attention layers in group 1 (slot j of
        both shares one tensor: pages of equal shape, as BART's)."""
        own = [i for i, s in enumerate(specs) if s.uses_kv_cache and i not in cross]
        pages = {_page_kind(specs[i]) for i in own + cross}
        check(len(pages) == 1 and len(own) == len(cross), "attention_specs", f"{len(own)} self + {len(cross)} "
              "cross layers", "as many decoder self-attention as cross-attention layers, all of one page shape")
        check(all(layer_retention(specs[i]).keeps_everything for i in own), "sliding_window",
              "set on a decoder layer", "None for encoder-decoder models")
        return cls((tuple(own), tuple(cross)), (RetentionPolicy(), RetentionPolicy()), encoder_group=1)

    @property
    def decoder_retentions(self) -> tuple[RetentionPolicy, ...]:
        """The groups whose tables grow with the decoder's tokens (the KV manager's groups)."""
        n = len(self.groups) - (self.encoder_group is not None)
        return self.retentions[:n]

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
        """Per model layer, the group whose attention metadata it reads (0 for layers without a
        cache: their metadata is unused; 0 for cross-attention layers: group 0's metadata carries
        the encoder tables)."""
        out = [0] * num_layers
        for g, layers in enumerate(self.groups):
            if g == self.encoder_group:
                continue
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
        """Per group [layers, [window, sinks]], and a third entry True for the encoder group."""
        return [[list(g), [r.sliding_window, r.num_sink_tokens], *([True] if i == self.encoder_group else [])]
                for i, (g, r) in enumerate(zip(self.groups, self.retentions))]

    @classmethod
    def from_wire(cls, obj: Sequence) -> KVGroupLayout:
        groups = tuple(tuple(int(i) for i in entry[0]) for entry in obj)
        retentions = tuple(RetentionPolicy(None if w is None else int(w), int(s)) for _, (w, s), *_ in obj)
        encoder = [i for i, entry in enumerate(obj) if len(entry) > 2 and entry[2]]
        return cls(groups, retentions, encoder_group=encoder[0] if encoder else None)
