"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron layout).

Column-parallel (q/k/v, gate/up): output rows split across ranks; row-parallel (o, down): input
columns split, their biases kept whole (the TP transform adds them once, after the
all-reduce); vocab-parallel (embeddings, LM head): vocabulary rows split into ceil(V / world)
parts; norms replicated. K/V heads split when there are at least as many as ranks, otherwise
each rank holds the one head its query heads use (heads replicated across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from meshserve.core.arith import cdiv
from meshserve.errors import check
from meshserve.parallel.transform import kv_head_offset, local_kv_heads
from meshserve.workers.models.arch import ModelArch


class Split(StrEnum):
    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0 split evenly
    KV_COLUMN = "kv_column"  # dim 0 split by K/V head, replicated when heads < ranks
    ROW = "row"  # dim 1 split evenly
    VOCAB = "vocab"  # dim 0 split into ceil(V / world) rows per rank
    DCP_GROUP = "dcp_group"  # dim 0 split into tp // dcp equal parts, one per DCP group (MLA kv_b_proj)
    LAST = "last"  # last dim split evenly (GPT-OSS experts' gate_up_proj [E, hidden, 2I] and its bias)


# Module name (second-to-last component of the tensor name) -> split rule for its weight.
SPLITS: dict[str, Split] = {
    "q_proj": Split.COLUMN,
    "q_b_proj": Split.COLUMN,  # DeepSeek: query heads after the q LoRA
    "kv_b_proj": Split.DCP_GROUP,  # DeepSeek: W_UK/W_UV of the query heads a DCP group attends for
    "k_proj": Split.KV_COLUMN,
    "v_proj": Split.KV_COLUMN,
    "gate_proj": Split.COLUMN,
    "up_proj": Split.COLUMN,
    "o_proj": Split.ROW,
    "down_proj": Split.ROW,
    "embed_tokens": Split.VOCAB,
    "lm_head": Split.VOCAB,
}


# GPT-OSS keeps all experts in one tensor per kind ('...mlp.experts.gate_up_proj'): split each
# expert's intermediate features (interleaved gate/up pairs stay together in an even slice).
EXPERT_SPLITS: dict[str, Split] = {
    "gate_up_proj": Split.LAST,
    "gate_up_proj_bias": Split.LAST,
    "down_proj": Split.ROW,  # [E, I, hidden]: dim 1
    "down_proj_bias": Split.REPLICATED,  # added once, by rank 0
}
# Per-head parameters named by their last component: GPT-OSS's sink logits [H] follow the query
# heads a rank attends for (under DCP: its whole DCP group's, gathered before attention).
PER_HEAD = ("sinks",)


@dataclass(frozen=True)
class Shard:
    """The slice [start:stop] along `dim` of a checkpoint tensor; dim None means the whole tensor."""

    dim: int | None
    start: int = 0
    stop: int | None = None


def split_of(name: str) -> Split:
    """The rule for checkpoint tensor `name` (e.g. 'model.layers.3.self_attn.k_proj.bias')."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else (parts[0], "weight")
    if module == "experts" and kind in EXPERT_SPLITS:
        return EXPERT_SPLITS[kind]
    if kind in PER_HEAD:
        return Split.DCP_GROUP
    split = SPLITS.get(module, Split.REPLICATED)
    if split is Split.ROW and kind == "bias":
        return Split.REPLICATED
    return split


def kv_heads_per_rank(arch: ModelArch, world: int, dcp: int = 1) -> int:
    return local_kv_heads(arch.num_kv_heads, world, dcp)


def shard_of(name: str, shape: tuple[int, ...], arch: ModelArch, rank: int, world: int, dcp: int = 1) -> Shard:
    """The part of tensor `name` (full shape `shape`) that rank `rank` of `world` holds.

    Under DCP (dcp > 1) the ranks of one DCP group hold the same K/V heads (they split tokens).
    """
    check(world >= 1, "world", world, "an integer >= 1")
    check(0 <= rank < world, "rank", rank, f"an integer in [0, {world - 1}]")
    split = split_of(name)
    if world == 1 or split is Split.REPLICATED:
        return Shard(None)
    if split is Split.VOCAB:
        per = cdiv(shape[0], world)
        return Shard(0, min(rank * per, shape[0]), min((rank + 1) * per, shape[0]))
    if split is Split.KV_COLUMN:
        d = arch.head_dim
        heads = local_kv_heads(arch.num_kv_heads, world, dcp)  # checks divisibility, names the values
        first = kv_head_offset(arch.num_kv_heads, world, dcp, rank)
        return Shard(0, first * d, (first + heads) * d)
    if split is Split.DCP_GROUP:
        groups = world // dcp
        check(shape[0] % groups == 0, "tp", world, f"tp/dcp dividing {shape[0]} (dim 0 of tensor {name})")
        per = shape[0] // groups
        return Shard(0, rank // dcp * per, (rank // dcp + 1) * per)
    dim = {Split.COLUMN: 0, Split.ROW: 1, Split.LAST: len(shape) - 1}[split]
    size = shape[dim]
    check(size % world == 0, "tp", world, f"a divisor of {size} (dim {dim} of tensor {name})")
    per = size // world
    return Shard(dim, rank * per, (rank + 1) * per)


def routed_experts(arch: ModelArch) -> int | None:
    """The number of routed experts of an MoE model (None: a dense model)."""
    if arch.experts is not None:
        return arch.experts.num_experts
    if arch.deepseek is not None:
        return arch.deepseek.moe.num_experts
    return None


@dataclass(frozen=True)
class ExpertPlace:
    """Where an expert tensor goes under expert parallelism: the model parameter (None: another
    rank's expert, not loaded here) and the part to read, {dim: (start, stop)}."""

    target: str | None
    box: dict[int, tuple[int, int | None]]


def place_expert(name: str, shape: tuple[int, ...], arch: ModelArch, rank: int, world: int,
                 ep: int) -> ExpertPlace | None:  # fmt: skip
    """With ep > 1, the place of an experts' tensor on `rank` of `world`; None for any other
    tensor, or when ep is 1 (shard_of's tensor-parallel rules apply).

    EP rank rank % ep holds routed experts [r E/ep, (r+1) E/ep), renumbered from 0 (DeepSeek's
    'experts.{e}.' modules) or sliced from GPT-OSS's [E, ...] banks; every expert tensor
    (shared experts too) is split tp/ep ways by the usual column/row rules, as rank rank // ep.
    """
    if ep == 1:
        return None
    parts = name.split(".")
    num = routed_experts(arch)
    check(num is not None and num % ep == 0, "ep", ep, f"a divisor of the number of routed experts ({num})")
    local, ep_rank = num // ep, rank % ep

    def features() -> dict[int, tuple[int, int | None]]:
        shard = shard_of(name, shape, arch, rank // ep, world // ep)
        return {} if shard.dim is None else {shard.dim: (shard.start, shard.stop)}

    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():  # DeepSeek routed expert
        expert = int(parts[-3]) - ep_rank * local
        if not 0 <= expert < local:
            return ExpertPlace(None, {})
        return ExpertPlace(".".join([*parts[:-3], str(expert), *parts[-2:]]), features())
    if len(parts) >= 3 and parts[-3] == "shared_experts":
        return ExpertPlace(name, features())
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_SPLITS:  # GPT-OSS expert bank
        return ExpertPlace(name, {0: (ep_rank * local, (ep_rank + 1) * local), **features()})
    return None
