"""HF checkpoint directory -> CausalLM with weights, for one tensor-parallel rank.

The model is built on the meta device (no memory, no random init), optionally reshaped by a
transform (tensor parallelism shrinks its layers), materialised empty on the target device,
then filled tensor by tensor from the memory-mapped safetensors, each cast to the model dtype
and sliced to this rank's shard. Every checkpoint tensor must land somewhere and every
parameter must be filled; otherwise the error names the tensor.

Quantized checkpoints (workers/quant/): before the model is materialised, the linears whose
checkpoint weights are FP8 (or all eligible linears, for online FP8) become Fp8Linear; their
scales travel with their weights. Weights that other code reads directly (MLA's kv_b_proj) and
MXFP4 experts are dequantized at load to the model dtype. The LM head joins them only when asked
(`quantize_lm_head`): per-channel FP8, quantized from the checkpoint's float head, or for tied
embeddings from the embedding, which itself stays in the model dtype (the head gets a copy).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from meshserve.config import Dtype, Quantization, SmallMGemm
from meshserve.core.arith import cdiv
from meshserve.core.checkpoint_files import read_json
from meshserve.errors import ConfigError, MeshserveError, as_enum, check
from meshserve.workers.checkpoint import Checkpoint, read_arch
from meshserve.workers.models import model_class
from meshserve.workers.models.arch import ModelArch
from meshserve.workers.models.deepseek import split_unstackable_mla
from meshserve.workers.models.moe import split_unaligned_mlps
from meshserve.workers.models.transformer import STACKED, CausalLM
from meshserve.workers.quant import loading as qload
from meshserve.workers.quant.formats import (
    SCALE_SUFFIX,
    QuantMethod,
    WeightFormat,
    WeightFormatRecord,
    WeightQuant,
    resolve_quantization,
)
from meshserve.workers.quant.fp8 import FP8, quantize_fp8_per_channel
from meshserve.workers.quant.layers import convert_linears, linear_names, stream_dense_linears
from meshserve.workers.quant.support import refusals
from meshserve.workers.sharding import kv_heads_per_rank, place_expert, shard_of

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Linears whose weight other code reads as a matrix (MLA folds kv_b_proj into its attention):
# FP8 checkpoint weights are dequantized at load for them, never kept as an Fp8Linear.
KEEP_FLOAT = ("kv_b_proj",)
# Online FP8 leaves these in the model dtype, as vLLM does: they choose tokens and experts. The
# LM head is quantized only on request (ModelConfig.quantize_lm_head: LM_HEAD, per-channel).
LM_HEAD = "lm_head"
ONLINE_SKIP = (LM_HEAD, "router", *KEEP_FLOAT)


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


def fused_parts(stacked: dict[str, tuple[str, int]]) -> dict[str, tuple[str, ...]]:
    """Fused module -> its checkpoint modules in row order, as a STACKED map declares them."""
    out: dict[str, list[str]] = {}
    for part, (fused, _) in sorted(stacked.items(), key=lambda item: item[1][1]):
        out.setdefault(fused, []).append(part)
    return {fused: tuple(parts) for fused, parts in out.items()}


def part_sizes(fused: str, arch: ModelArch, world: int, dcp: int, rows: int) -> tuple[int, ...]:
    """Rows of each part inside this rank's fused matrix of `rows` rows (gate_up: two halves,
    whatever the MLP's width: DeepSeek's dense, shared and routed MLPs differ; MLA's q_kv_a_proj:
    this rank's q rows, then the whole kv_a_proj_with_mqa)."""
    if fused == "qkv_proj":
        kv = kv_heads_per_rank(arch, world, dcp) * arch.head_dim
        return (arch.q_size // world, kv, kv)
    if fused == "q_kv_a_proj":
        latent = arch.deepseek.mla.latent_size
        return (rows - latent, latent)
    return (rows // 2,) * 2


def _target(name: str, arch: ModelArch, world: int, dcp: int, params: dict[str, torch.nn.Parameter],
            stacked: dict[str, tuple[str, int]] = STACKED) -> tuple[str, int | None, int | None]:  # fmt: skip
    """Checkpoint name -> (model parameter name, row offset, rows) inside a fused parameter. A
    part whose fused parameter the model lacks loads as itself (an MLP split for FP8 block scales)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in stacked:
        fused, index = stacked[parts[-2]]
        target = ".".join([*parts[:-2], fused, parts[-1]])
        if target in params or name not in params:
            sizes = part_sizes(fused, arch, world, dcp, params[target].shape[0] if target in params else 0)
            return target, sum(sizes[:index]), sizes[index]
    return name, None, None


def _is_last(name: str, stacked: dict[str, tuple[str, int]] = STACKED) -> bool:
    """Whether `name` is the last part of its fused parameter (its rows must end the matrix)."""
    fused, index = stacked[name.split(".")[-2]]
    return index == len(fused_parts(stacked)[fused]) - 1


def _expected(params: dict[str, torch.nn.Parameter], parts_of: dict[str, tuple[str, ...]]) -> set[str]:
    """Checkpoint tensor names the model's parameters need."""
    out: set[str] = set()
    for pname in params:
        parts = pname.split(".")
        if len(parts) >= 2 and parts[-2] in parts_of:
            out |= {".".join([*parts[:-2], p, parts[-1]]) for p in parts_of[parts[-2]]}
        else:
            out.add(pname)
    return out


def _is_mtp(name: str, arch: ModelArch) -> bool:
    mtp = arch.deepseek.num_mtp_layers if arch.deepseek is not None else 0
    parts = name.split(".")
    return (mtp > 0 and len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and arch.num_layers <= int(parts[2]) < arch.num_layers + mtp)


def fp8_modules(model: CausalLM, quant: WeightQuant, names: set[str]) -> set[str]:
    """Module names of the linears that become Fp8Linear: those whose checkpoint weights ship
    FP8 scales (every part of a fused one), or every eligible linear for online FP8."""
    fused = fused_parts(model.STACKED)
    chosen = set()
    for module in linear_names(model):
        prefix, _, last = module.rpartition(".")
        if quant.online:
            if last not in ONLINE_SKIP:
                chosen.add(module)
            continue
        stems = [f"{prefix}.{p}" for p in fused[last]] if last in fused else [module]
        scaled = [stem + SCALE_SUFFIX in names for stem in stems]
        if any(scaled) and not all(scaled):
            raise WeightError(f"checkpoint quantizes only some of {stems} (FP8 scales for {scaled}); the "
                              f"fused '{module}' needs all or none")
        if all(scaled) and last not in KEEP_FLOAT:
            chosen.add(module)
    return chosen


def _store_scale(model_buffers: dict[str, torch.Tensor], target: str, scale: torch.Tensor,
                 offset: int | None, rows: int | None, is_last: bool, block: tuple[int, int] | None) -> None:
    """Copy a weight's scales into its module's buffer (the rows of a fused part, in scale rows)."""
    module = target.rpartition(".")[0]
    key = next((k for k in (f"{module}.weight_scale_inv", f"{module}.weight_scale", f"{target}_scales")
                if k in model_buffers), None)
    if key is None:
        raise WeightError(f"model parameter '{target}' has no scale buffer for its quantized checkpoint weight")
    dest = model_buffers[key]
    if offset is not None:
        per = block[0] if block is not None and key.endswith(SCALE_SUFFIX) else 1
        if offset % per or (rows % per and not is_last):
            raise WeightError(f"'{target}' fuses parts whose rows ({rows} at {offset}) cut a {per}-row FP8 scale "
                              "block; this checkpoint cannot be served fused")
        dest = dest.narrow(0, offset // per, cdiv(rows, per))
    if tuple(dest.shape) != tuple(scale.shape):
        raise WeightError(f"scales for '{target}' have shape {tuple(scale.shape)} but the model expects "
                          f"{tuple(dest.shape)} (does weight_block_size match the tensors?)")
    dest.copy_(scale)


def load_weights(model: CausalLM, ckpt: Checkpoint, *, rank: int = 0, world: int = 1, dcp: int = 1,
                 ep: int = 1, progress: bool = True, quant: WeightQuant | None = None) -> None:
    """Fill every parameter of `model` from `ckpt`, slicing each tensor for `rank` of `world`
    (`dcp`: ranks of one DCP group share K/V heads; `ep`: ranks of one EP group split the
    routed experts, sharding.place_expert; `quant`: the checkpoint's or online quantization)."""
    arch = model.arch
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    buffers = dict(model.named_buffers())
    modules = dict(model.named_modules())

    def shard_fn(name: str, shape: tuple[int, ...], w: int, r: int):
        return shard_of(name, shape, arch, r, w, dcp if w == world else 1)
    # A model class may fuse differently (or not at all): it says so with its own STACKED map.
    stacked = model.STACKED
    expected = _expected(params, fused_parts(stacked))
    names = ckpt.names()
    name_set = set(names)
    loaded: set[str] = set()
    bar = tqdm(names, desc="Loading weights", unit="tensor", file=sys.stderr, disable=not progress,
               leave=False)
    for name in bar:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived from the config; some old checkpoints store it
        if arch.tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding serves as the LM head
        if _is_mtp(name, arch):
            continue  # DeepSeek-V3's multi-token-prediction layer: speculative decoding only
        if qload.is_companion(name, name_set):
            continue  # scales: read with their weight
        pname = qload.param_of(name)
        place = place_expert(pname, ckpt.shape(name), arch, rank, world, ep)
        if place is not None and place.target is None:
            continue  # another EP rank's expert
        target, offset, rows = _target(place.target if place else pname, arch, world, dcp, params, stacked)
        if target not in params:
            raise WeightError(f"checkpoint tensor '{name}' {ckpt.shape(name)} has no place in the "
                              f"{arch.architecture} model (unexpected tensor in {ckpt.model_dir})")
        dest = params[target].data
        if place is not None:  # an expert tensor under EP (load_model refuses EP with quantized weights)
            read = qload.Loaded(ckpt.read_box(name, place.box), None, (place.target,))
        else:
            read = qload.read_quantized(ckpt, name, name_set, quant=quant, dest=dest, world=world, rank=rank,
                                        shard_fn=shard_fn)
        tensor = read.values
        if read.scale is not None:
            _store_scale(buffers, target, read.scale, offset, rows, offset is not None and _is_last(pname, stacked),
                         quant.block if quant is not None else None)
        elif pname != name:  # MXFP4 experts dequantized at load: say so where the MoE can see it
            modules[target.rpartition(".")[0]].weight_format = WeightFormatRecord(
                WeightFormat.MXFP4, str(dest.dtype).removeprefix("torch."))
        where = f" (rank {rank} of {world})" if world > 1 else ""
        if offset is not None:
            if offset + rows > dest.shape[0] or (offset + rows == dest.shape[0]) != _is_last(name, stacked):
                raise WeightError(f"checkpoint tensor '{pname}' ({rows} rows{where}) does not fit the fused "
                                  f"model parameter '{target}' {tuple(dest.shape)}")
            dest = dest.narrow(0, offset, rows)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightError(f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}{where} but the "
                              f"model expects {tuple(dest.shape)} for '{target}'")
        dest.copy_(tensor)
        loaded.update((pname, *read.consumed) if place is None else read.consumed)
    if arch.tie_word_embeddings and model.lm_head.weight.dtype == FP8 and "model.embed_tokens.weight" in loaded:
        _fill_tied_fp8_head(model)
        loaded.add("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightError(f"checkpoint {ckpt.model_dir} lacks tensor(s) {missing[:5]}{more} "
                          f"needed by {arch.architecture}")


def _fill_tied_fp8_head(model: CausalLM) -> None:
    """quantize_lm_head on tied embeddings: the head's FP8 rows and scales are quantized from the
    embedding this rank holds (the embedding and the head split the vocabulary alike, ceil(V / tp)
    rows a rank), which stays in the model dtype for its lookups."""
    embed, head = model.model.embed_tokens.weight, model.lm_head
    if tuple(head.weight.shape) != tuple(embed.shape):
        raise WeightError(f"the FP8 LM head {tuple(head.weight.shape)} and the tied embedding {tuple(embed.shape)} "
                          "hold different rows")
    q, scale = quantize_fp8_per_channel(embed)
    head.weight.copy_(q)
    head.weight_scale.copy_(scale)


class _NoInitOnMeta(TorchFunctionMode):
    """Skips torch.nn.init's functions while a model is built on the meta device: to_empty throws
    their values away, and on meta they go through torch._refs, whose first call imports
    torch._dynamo (~1 s of every process that builds a model: a server, a Ray actor, a rank)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_model(arch: ModelArch, *, dtype: torch.dtype, device: str | torch.device,
                max_positions: int | None = None,
                transform: Callable[[CausalLM], None] | None = None,
                quantize: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """An unfilled model on `device` (weights uninitialised), built without touching memory first.

    `quantize` swaps layers for quantized ones after the dtype cast (which would cast FP8 too)."""
    with torch.device("meta"), _NoInitOnMeta():
        model = model_class(arch)(arch, max_positions=max_positions)
    if transform is not None:
        transform(model)
    model = model.to(dtype)
    if quantize is not None:
        with torch.device("meta"):
            quantize(model)
    model = model.to_empty(device=device)
    if arch.tie_word_embeddings and model.lm_head.weight.dtype != FP8:  # an FP8 head keeps its own copy
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties shared meta params
    return model.eval()


def _check_served(quant: WeightQuant, device: torch.device, *, lm_head: bool = False) -> None:
    """Refuse a weight format this device cannot compute (support.py says why), before any weight is
    read; `lm_head`: the per-channel FP8 head (quantize_lm_head) too."""
    fmt = quant.linear_format if quant.method is QuantMethod.FP8 else WeightFormat.MXFP4
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reasons = refusals(fmt, device.type, cc, quant.block)
    if reasons:
        raise ConfigError("quantization", str(fmt), "; ".join(reasons))
    head = refusals(WeightFormat.FP8_CHANNEL, device.type, cc) if lm_head and fmt is not WeightFormat.FP8_CHANNEL \
        else []
    if head:
        raise ConfigError("quantize_lm_head", True, "; ".join(head))


def load_model(model_dir: str | Path, *, dtype: str | Dtype | torch.dtype | None = None,
               device: str | torch.device = "cpu", rank: int = 0, world: int = 1, dcp: int = 1, ep: int = 1,
               max_positions: int | None = None, progress: bool = True,
               transform: Callable[[CausalLM], None] | None = None,
               quantization: str | None = None, small_m_gemm: str | SmallMGemm = SmallMGemm.AUTO,
               quantize_lm_head: bool = False) -> CausalLM:
    """Load the HF checkpoint in `model_dir` as rank `rank` of a `world`-way tensor-parallel group.

    `transform` reshapes the meta-device model before weights arrive (tensor parallelism); a
    plain model takes world == 1. `quantization`: None/"none", or "fp8" to quantize a float
    checkpoint's linears at load (quantized checkpoints load as published either way).
    `small_m_gemm` (ModelConfig.small_m_gemm): which linears take a weight-streaming kernel for
    decode-sized inputs on CUDA - auto: every FP8 linear (the kernel per rows bucket and weight
    format: workers/quant/gemm_table.py); on: those and the bf16/fp16 decoder projections; off: none.
    `quantize_lm_head` (ModelConfig.quantize_lm_head, with quantization "fp8" only): the LM head
    in per-channel FP8 too (a tied one as an FP8 copy of the embedding; an FP8 checkpoint's float
    head likewise; a head the checkpoint ships in FP8 stays as published).
    """
    streaming = as_enum(SmallMGemm, "small_m_gemm", small_m_gemm)
    arch = read_arch(model_dir)
    torch_dtype = resolve_dtype(dtype, arch, str(torch.device(device)))
    quant = resolve_quantization(read_json(Path(model_dir) / "config.json", "model"), quantization)
    check(isinstance(quantize_lm_head, bool), "quantize_lm_head", quantize_lm_head, "true or false")
    asked = "none" if quantization is None else str(quantization).lower()
    check(not quantize_lm_head or asked == Quantization.FP8, "quantize_lm_head", quantize_lm_head,
          f"false with quantization='{asked}' (the LM head is quantized only with quantization='fp8')")
    if quant is not None:
        _check_served(quant, torch.device(device), lm_head=quantize_lm_head)
        check(ep == 1, "ep", ep, "1 with quantized weights (expert parallelism over FP8/MXFP4 experts is not "
              "implemented yet)")
    with torch.no_grad(), Checkpoint(model_dir) as ckpt:
        fp8 = quant is not None and quant.method is QuantMethod.FP8
        names = set(ckpt.names()) if fp8 else set()

        def convert(model: CausalLM) -> None:
            if fp8:
                if quant.block is not None:  # a block scale must not straddle gate and up
                    split_unaligned_mlps(model, quant.block[0])
                # nor MLA's q and kv_a rows; nor may one of them be FP8 and the other not
                split_unstackable_mla(model, quant.block and quant.block[0],
                                      lambda module: quant.online or module + SCALE_SUFFIX in names)
                small_m = streaming is not SmallMGemm.OFF
                chosen = fp8_modules(model, quant, names)
                convert_linears(model, chosen, quant.block, small_m=small_m)
                if quantize_lm_head and LM_HEAD not in chosen:  # (a head shipped in FP8 is in `chosen`)
                    convert_linears(model, {LM_HEAD}, None, small_m=small_m)
            if streaming is SmallMGemm.ON:
                stream_dense_linears(model)

        model = build_model(arch, dtype=torch_dtype, device=device, max_positions=max_positions,
                            transform=transform, quantize=convert if fp8 or streaming is SmallMGemm.ON else None)
        load_weights(model, ckpt, rank=rank, world=world, dcp=dcp, ep=ep, progress=progress, quant=quant)
        model.finish_loading(device)  # rotary tables; MoE layers: expert layouts, counters
    return model
