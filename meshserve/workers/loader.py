"""HF checkpoint directory -> CausalLM with weights, for one tensor-parallel rank.

The model is built on the meta device (no memory, no random init), optionally reshaped by a
transform (tensor parallelism shrinks its layers), materialised empty on the target device,
then filled tensor by tensor from the memory-mapped safetensors, each cast to the model dtype
and sliced to this rank's shard. Every checkpoint tensor must land somewhere and every
parameter must be filled; otherwise the error names the tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from meshserve.config import Dtype
from meshserve.errors import MeshserveError, as_enum
from meshserve.workers.checkpoint import Checkpoint, read_arch
from meshserve.workers.models import model_class
from meshserve.workers.models.arch import ModelArch
from meshserve.workers.models.transformer import CausalLM
from meshserve.workers.sharding import kv_heads_per_rank, place_expert, shard_of

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Checkpoint module -> (fused model module, index of its part along dim 0).
STACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class WeightError(MeshserveError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape; the message names it."""


def resolve_dtype(dtype: str | Dtype | torch.dtype | None, arch: ModelArch, device: str) -> torch.dtype:
    """The activation/weight dtype: AUTO = the checkpoint's, but float32 for half precision on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    choice = as_enum(Dtype, "dtype", dtype or Dtype.AUTO)
    if choice is not Dtype.AUTO:
        return TORCH_DTYPES[choice.value]
    native = TORCH_DTYPES.get(arch.torch_dtype, torch.float32)
    return torch.float32 if torch.device(device).type == "cpu" else native


def part_sizes(fused: str, arch: ModelArch, world: int, dcp: int = 1) -> tuple[int, ...]:
    """Rows of each part inside this rank's fused matrix."""
    if fused == "qkv_proj":
        kv = kv_heads_per_rank(arch, world, dcp) * arch.head_dim
        return (arch.q_size // world, kv, kv)
    return (arch.intermediate_size // world,) * 2


def _target(name: str, arch: ModelArch, world: int, dcp: int,
            stacked: dict[str, tuple[str, int]] = STACKED) -> tuple[str, int | None, int | None]:  # fmt: skip
    """Checkpoint name -> (model parameter name, row offset, rows) inside a fused parameter."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in stacked:
        fused, index = stacked[parts[-2]]
        sizes = part_sizes(fused, arch, world, dcp)
        return ".".join([*parts[:-2], fused, parts[-1]]), sum(sizes[:index]), sizes[index]
    return name, None, None


def _is_last(name: str) -> bool:
    """Whether `name` is the last part of its fused parameter (its rows must end the matrix)."""
    module = name.split(".")[-2]
    fused, index = STACKED[module]
    return index == len(FUSED_PARTS[fused]) - 1


def _expected(params: dict[str, torch.nn.Parameter], fused_parts: dict[str, tuple[str, ...]]) -> set[str]:
    """Checkpoint tensor names the model's parameters need."""
    out: set[str] = set()
    for pname in params:
        parts = pname.split(".")
        if len(parts) >= 2 and parts[-2] in fused_parts:
            out |= {".".join([*parts[:-2], p, parts[-1]]) for p in FUSED_PARTS[parts[-2]]}
        else:
            out.add(pname)
    return out


def load_weights(model: CausalLM, ckpt: Checkpoint, *, rank: int = 0, world: int = 1, dcp: int = 1,
                 ep: int = 1, progress: bool = True) -> None:
    """Fill every parameter of `model` from `ckpt`, slicing each tensor for `rank` of `world`
    (`dcp`: ranks of one DCP group share K/V heads; `ep`: ranks of one EP group split the
    routed experts, sharding.place_expert)."""
    arch = model.arch
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    # A model class may fuse differently (or not at all): it says so with its own STACKED map.
    stacked = getattr(model, "STACKED", STACKED)
    fused_parts = {f: FUSED_PARTS[f] for f, _ in stacked.values()}
    expected = _expected(params, fused_parts)
    names = ckpt.names()
    loaded: set[str] = set()
    bar = tqdm(names, desc="Loading weights", unit="tensor", file=sys.stderr, disable=not progress,
               leave=False)
    for name in bar:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived from the config; some old checkpoints store it
        if arch.tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding serves as the LM head
        place = place_expert(name, ckpt.shape(name), arch, rank, world, ep)
        if place is not None and place.target is None:
            continue  # another EP rank's expert
        target, offset, rows = (place.target, None, None) if place else _target(name, arch, world, dcp, stacked)
        if target not in params:
            raise WeightError(f"checkpoint tensor '{name}' {ckpt.shape(name)} has no place in the "
                              f"{arch.architecture} model (unexpected tensor in {ckpt.model_dir})")
        if place is not None:
            tensor = ckpt.read_box(name, place.box)
        else:
            shard = shard_of(name, ckpt.shape(name), arch, rank, world, dcp)
            tensor = ckpt.read(name, shard.dim, shard.start, shard.stop)
        dest = params[target].data
        where = f" (rank {rank} of {world})" if world > 1 else ""
        if offset is not None:
            if offset + rows > dest.shape[0] or (offset + rows == dest.shape[0]) != _is_last(name):
                raise WeightError(f"checkpoint tensor '{name}' ({rows} rows{where}) does not fit the fused "
                                  f"model parameter '{target}' {tuple(dest.shape)}")
            dest = dest.narrow(0, offset, rows)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}{where} but the "
                              f"model expects {tuple(dest.shape)} for '{target}'")
        dest.copy_(tensor)
        loaded.add(name if place is None else target)
    missing = sorted(expected - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightError(f"checkpoint {ckpt.model_dir} lacks tensor(s) {missing[:5]}{more} "
                          f"needed by {arch.architecture}")


def build_model(arch: ModelArch, *, dtype: torch.dtype, device: str | torch.device,
                max_positions: int | None = None,
                transform: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """An unfilled model on `device` (weights uninitialised), built without touching memory first."""
    with torch.device("meta"):
        model = model_class(arch)(arch, max_positions=max_positions)
    if transform is not None:
        transform(model)
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary.reset_tables(device)
    if getattr(model.model, "local_rotary", None) is not None:
        model.model.local_rotary.reset_tables(device)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties shared meta params
    return model.eval()


def load_model(model_dir: str | Path, *, dtype: str | Dtype | torch.dtype | None = None,
               device: str | torch.device = "cpu", rank: int = 0, world: int = 1, dcp: int = 1, ep: int = 1,
               max_positions: int | None = None, progress: bool = True,
               transform: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """Load the HF checkpoint in `model_dir` as rank `rank` of a `world`-way tensor-parallel group.

    `transform` reshapes the meta-device model before weights arrive (tensor parallelism); a
    plain model takes world == 1.
    """
    arch = read_arch(model_dir)
    torch_dtype = resolve_dtype(dtype, arch, str(torch.device(device)))
    model = build_model(arch, dtype=torch_dtype, device=device, max_positions=max_positions,
                        transform=transform)
    with torch.no_grad(), Checkpoint(model_dir) as ckpt:
        load_weights(model, ckpt, rank=rank, world=world, dcp=dcp, ep=ep, progress=progress)
        # Modules that want a say once their weights are in (MoE layers: expert layouts, counters).
        for module in [m for m in model.modules() if hasattr(m, "finish_loading")]:
            module.finish_loading(device)
    return model
