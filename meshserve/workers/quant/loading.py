"""Reading quantized checkpoint tensors for one tensor-parallel rank.

The loader (workers/loader.py) asks `read_quantized` for each checkpoint tensor; this module
knows which companions travel with a weight (FP8 `weight_scale_inv`, MXFP4 `_scales`), how a
rank's slice of a weight maps to its slice of the scales (a TP split may not cut a scale
block), and what the destination wants: FP8 values plus scales for an Fp8Linear, or float
values (dequantized at load) for a plain parameter such as MLA's kv_b_proj or GPT-OSS experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshserve.core.arith import cdiv
from meshserve.errors import ConfigError, MeshserveError
from meshserve.workers.checkpoint import Checkpoint
from meshserve.workers.quant.formats import MXFP4_GROUP, MXFP4_SUFFIXES, SCALE_SUFFIX, WeightQuant
from meshserve.workers.quant.fp8 import FP8, dequantize_fp8_block, quantize_fp8_per_channel
from meshserve.workers.quant.mxfp4 import dequantize_mxfp4
from meshserve.workers.sharding import Shard

ShardFn = Callable[[str, tuple[int, ...], int], Shard]  # (name, full shape, world) -> this rank's slice


class QuantLoadError(MeshserveError):
    """A quantized tensor cannot be placed: a split would cut a scale block, or a companion is missing."""


@dataclass
class Loaded:
    """values: what the parameter receives; scale: FP8 scales for an Fp8Linear's buffer (None for
    float destinations); consumed: every checkpoint name this read used (weight and companions)."""

    values: torch.Tensor
    scale: torch.Tensor | None
    consumed: tuple[str, ...]


def is_companion(name: str, names: set[str]) -> bool:
    """Scales are read with the weight they belong to, never on their own."""
    if name.endswith(SCALE_SUFFIX):
        return name[: -len(SCALE_SUFFIX)] + ".weight" in names
    blocks, scales = MXFP4_SUFFIXES
    return name.endswith(scales) and name[: -len(scales)] + blocks in names


def param_of(name: str) -> str:
    """The model parameter a checkpoint tensor fills ('experts.down_proj_blocks' -> 'experts.down_proj')."""
    blocks = MXFP4_SUFFIXES[0]
    return name[: -len(blocks)] if name.endswith(blocks) else name


def fp8_scale_name(name: str, names: set[str]) -> str | None:
    """The `weight_scale_inv` beside weight `name`, when the checkpoint has one."""
    if not name.endswith(".weight"):
        return None
    scale = name[: -len(".weight")] + SCALE_SUFFIX
    return scale if scale in names else None


def _aligned(shard: Shard, size: int, block: int) -> bool:
    stop = size if shard.stop is None else shard.stop
    return shard.start % block == 0 and (stop % block == 0 or stop == size)


def _working_tp(name: str, shape: tuple[int, ...], shard_fn: ShardFn, blocks: tuple[int, ...]) -> list[int]:
    ok = []
    for world in range(1, 65):
        try:
            shards = [shard_fn(name, shape, world, rank) for rank in range(world)]
        except ConfigError:
            continue
        if all(s.dim is None or _aligned(s, shape[s.dim], blocks[s.dim]) for s in shards):
            ok.append(world)
    return ok


def _block_shard(name: str, shape: tuple[int, ...], shard: Shard, blocks: tuple[int, ...], world: int,
                 shard_fn: ShardFn, what: str) -> Shard:  # fmt: skip
    """This rank's slice of the scales (or MXFP4 groups) that go with weight slice `shard`."""
    if shard.dim is None:
        return shard
    size, block = shape[shard.dim], blocks[shard.dim]
    if not _aligned(shard, size, block):
        raise QuantLoadError(
            f"tp={world} would cut a {what} of '{name}' (dim {shard.dim}: {size} split at "
            f"{shard.start}..{shard.stop}, blocks of {block}); tp values that work for it: "
            f"{_working_tp(name, shape, shard_fn, blocks)}")
    stop = size if shard.stop is None else shard.stop
    return Shard(shard.dim, shard.start // block, cdiv(stop, block))


def read_quantized(ckpt: Checkpoint, name: str, names: set[str], *, quant: WeightQuant | None,
                   dest: torch.Tensor, world: int, rank: int, shard_fn: ShardFn) -> Loaded:  # fmt: skip
    """Checkpoint tensor `name` (with its companions) as rank `rank` of `world` places it in `dest`."""
    blocks_suffix, scales_suffix = MXFP4_SUFFIXES
    if name.endswith(blocks_suffix):
        return _read_mxfp4(ckpt, name, names, dest=dest, world=world, rank=rank, shard_fn=shard_fn)
    shape = ckpt.shape(name)
    scale_name = fp8_scale_name(name, names)
    shard = shard_fn(name, shape, world, rank)
    if scale_name is not None:
        if quant is None or quant.block is None:
            raise QuantLoadError(f"checkpoint tensor '{scale_name}' needs quantization_config.weight_block_size "
                                 "in config.json (an FP8 block-scaled checkpoint)")
        s_shard = _block_shard(name, shape, shard, quant.block, world, shard_fn, f"{quant.block} FP8 scale block")
        weight = ckpt.read(name, shard.dim, shard.start, shard.stop)
        scale = ckpt.read(scale_name, s_shard.dim, s_shard.start, s_shard.stop).float()
        if weight.dtype != FP8:
            raise QuantLoadError(f"checkpoint tensor '{name}' is {weight.dtype} but has '{scale_name}': "
                                 "float8_e4m3fn expected")
        if dest.dtype == FP8:
            return Loaded(weight, scale, (name, scale_name))
        weight, scale = weight.to(dest.device), scale.to(dest.device)  # dequantize where the model lives
        return Loaded(dequantize_fp8_block(weight, scale, quant.block, dest.dtype), None, (name, scale_name))
    tensor = ckpt.read(name, shard.dim, shard.start, shard.stop)
    if dest.dtype == FP8:  # online FP8: a float checkpoint quantized per output channel
        if tensor.dtype == FP8:
            raise QuantLoadError(f"checkpoint tensor '{name}' is float8 without a weight_scale_inv beside it")
        q, scale = quantize_fp8_per_channel(tensor.to(dest.device))  # on the GPU when the model is
        return Loaded(q, scale, (name,))
    if tensor.dtype == FP8:
        raise QuantLoadError(f"checkpoint tensor '{name}' is float8_e4m3fn without a "
                             f"'{name.removesuffix('.weight')}{SCALE_SUFFIX}' beside it")
    return Loaded(tensor, None, (name,))


def _read_mxfp4(ckpt: Checkpoint, name: str, names: set[str], *, dest: torch.Tensor, world: int, rank: int,
                shard_fn: ShardFn) -> Loaded:  # fmt: skip
    """GPT-OSS experts: blocks [E, out, G, 16] + scales [E, out, G] -> the float parameter [E, in, out]
    (HF's layout), this rank's slice, dequantized to dest's dtype (the interim path: the MoE
    computes in the model dtype until the fused MoE reads MXFP4 itself).

    The seam for that MoE: a uint8 destination receives this rank's packed blocks [E, out, G, 16]
    as they are, and `scale` the e8m0 scales [E, out, G], for a kernel that dequantizes in registers."""
    pname = param_of(name)
    scales_name = pname + MXFP4_SUFFIXES[1]
    if scales_name not in names:
        raise QuantLoadError(f"checkpoint tensor '{name}' has no '{scales_name}' beside it")
    experts, out, groups, _ = ckpt.shape(name)
    full = (experts, groups * MXFP4_GROUP, out)  # the parameter's [E, in, out]
    shard = shard_fn(pname, full, world, rank)
    packed = dest.dtype == torch.uint8
    cut = slice(None)  # which of the dequantized input features this rank keeps
    if shard.dim is None:
        b_dim, b_shard = None, Shard(None)
    elif shard.dim == 2:  # output features: rows of every expert's blocks
        b_dim, b_shard = 1, Shard(1, shard.start, shard.stop)
    elif packed:  # input features, kept packed: only whole groups of 32 can be split
        b_dim = 2
        b_shard = _block_shard(pname, full, shard, (1, MXFP4_GROUP, 1), world, shard_fn, "32-value MXFP4 group")
    else:  # input features, dequantized: the groups around the slice, then the slice itself
        # (gpt-oss's 2880 features split 4 or 8 ways cut groups: 720 and 360 are not multiples of 32)
        b_dim, first = 2, shard.start // MXFP4_GROUP
        b_shard = Shard(2, first, cdiv(shard.stop, MXFP4_GROUP))
        cut = slice(shard.start - first * MXFP4_GROUP, shard.stop - first * MXFP4_GROUP)
    blocks = ckpt.read(name, b_dim, b_shard.start, b_shard.stop)
    scales = ckpt.read(scales_name, b_dim, b_shard.start, b_shard.stop)
    if packed:
        return Loaded(blocks, scales, (name, scales_name))
    values = dequantize_mxfp4(blocks.to(dest.device), scales.to(dest.device), dest.dtype)  # [E, out_local, in]
    return Loaded(values[..., cut].transpose(1, 2), None, (name, scales_name))  # [E, in_local, out_local]
