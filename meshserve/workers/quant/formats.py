"""Weight formats a checkpoint can ship, read from its config.json `quantization_config`.

Published conventions (checked against HF transformers' finegrained_fp8 / mxfp4 integrations and
vLLM's fp8 block quantization):
- FP8 block-scaled (DeepSeek-V3/R1, Qwen3-*-FP8): `{"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`; each quantized linear
  stores `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
  [ceil(out / 128), ceil(in / 128)] (real value = fp8 value * scale of its block). Embeddings,
  LM head, norms and router gates stay in the checkpoint dtype, as do the modules named by
  `modules_to_not_convert` (HF) or `ignored_layers` (vLLM): the loader believes the tensors,
  quantizing exactly the modules that ship a `weight_scale_inv`.
- MXFP4 (GPT-OSS experts): `{"quant_method": "mxfp4"}`; `*_blocks` uint8 [E, out, in / 32, 16]
  (two e2m1 values per byte, low nibble first) and `*_scales` uint8 [E, out, in / 32] (e8m0:
  the group's scale is 2 ** (byte - 127)).
- Online FP8 (`--quantization fp8`): a bf16/fp32 checkpoint whose linear weights are quantized
  at load, one float32 scale per output channel (vLLM's online FP8).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from meshserve.errors import ConfigError, check

# Rows (tokens) up to which a linear runs the weight-streaming kernel (small_m.py) on CUDA rather
# than a tiled GEMM: FP8 weights always (W8A16), bf16/fp16 weights when ModelConfig.small_m_gemm
# says so. M rows cost 2 * M FLOPs per weight: at M = 16, 32 FLOPs per FP8 byte (16 per bf16
# byte), far below the H200's balance (~165 FLOP/byte for 790 TFLOP/s over 4.8 TB/s), so the
# time is the weight read. tl.dot's smallest row tile is 16, so rows 1..16 cost the same
# instructions and activation traffic; a 17th row needs a second row tile (twice the activation
# loads and conversions per weight), where the W8A8 tensor-core paths start to repay their
# activation quantization. 17..64 rows stay on the tiled paths until measured (the bench times
# both at M = 16 and 64).
SMALL_M_MAX = 16


class QuantMethod(StrEnum):
    FP8 = "fp8"
    MXFP4 = "mxfp4"


class WeightFormat(StrEnum):
    """How one module's weights are stored in memory (what the compute must read)."""

    FP8_BLOCK = "fp8_block"  # float8_e4m3fn + float32 scale per [block_n, block_k] block
    FP8_CHANNEL = "fp8_channel"  # float8_e4m3fn + float32 scale per output row (online FP8)
    MXFP4 = "mxfp4"  # packed e2m1 + e8m0 scale per 32 inputs


SCALE_SUFFIX = ".weight_scale_inv"  # FP8 block scales, next to '.weight'
MXFP4_SUFFIXES = ("_blocks", "_scales")  # GPT-OSS: 'experts.gate_up_proj_blocks' / '_scales'
MXFP4_GROUP = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class WeightQuant:
    """A checkpoint's (or the --quantization flag's) weight quantization.

    method: fp8 or mxfp4. block: FP8 [block_n, block_k] (rows, columns per scale); None for
    per-channel online FP8 and for MXFP4. online: quantize a float checkpoint at load.
    not_converted: module names/patterns the config says stay unquantized (informational; the
    tensors decide).
    """

    method: QuantMethod
    block: tuple[int, int] | None = None
    online: bool = False
    not_converted: tuple[str, ...] = ()

    @property
    def linear_format(self) -> WeightFormat:
        return WeightFormat.FP8_CHANNEL if self.block is None else WeightFormat.FP8_BLOCK


ONLINE_FP8 = WeightQuant(QuantMethod.FP8, block=None, online=True)
ONLINE_METHODS = ("none", "fp8")  # the --quantization values


def resolve_quantization(cfg: dict[str, Any], online: str | None) -> WeightQuant | None:
    """The quantization to load with: the checkpoint's own, else online FP8 when asked for.

    online: None / "none", or "fp8" (a float checkpoint's linears quantized at load; an FP8
    checkpoint is served as published; an MXFP4 one is refused, its experts are not FP8)."""
    choice = "none" if online is None else str(online).lower()
    check(choice in ONLINE_METHODS, "quantization", online, f"one of {list(ONLINE_METHODS)}")
    published = parse_quantization_config(cfg)
    if choice == "none" or (published is not None and published.method is QuantMethod.FP8):
        return published
    check(published is None, "quantization", online,
          f"'none' for this {published.method if published else ''} checkpoint (it is quantized already)")
    return ONLINE_FP8


def parse_quantization_config(cfg: dict[str, Any]) -> WeightQuant | None:
    """config.json (whole dict) -> its WeightQuant, None when unquantized; bad values name the field."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    field = "config.json:quantization_config"
    check(isinstance(qc, dict), field, qc, "an object with a quant_method")
    method = qc.get("quant_method")
    supported = [m.value for m in QuantMethod]
    if method not in supported:
        raise ConfigError(f"{field}.quant_method", method, f"one of {supported} (the formats meshserve loads)")
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    if method == QuantMethod.MXFP4:
        return WeightQuant(QuantMethod.MXFP4, not_converted=skip)
    fmt = qc.get("fmt", "e4m3")
    check(fmt == "e4m3", f"{field}.fmt", fmt, "'e4m3' (float8_e4m3fn weights)")
    scheme = qc.get("activation_scheme", "dynamic")
    check(scheme == "dynamic", f"{field}.activation_scheme", scheme,
          "'dynamic' (activations quantized per token group at run time; static scales are not supported)")
    block = qc.get("weight_block_size")
    ok = (isinstance(block, list | tuple) and len(block) == 2
          and all(isinstance(b, int) and b >= 1 and b & (b - 1) == 0 for b in block))
    check(ok, f"{field}.weight_block_size", block,
          "[block_n, block_k], powers of two (published checkpoints: [128, 128]); per-tensor FP8 "
          "checkpoints are not supported")
    return WeightQuant(QuantMethod.FP8, block=(int(block[0]), int(block[1])), not_converted=skip)


@dataclass(frozen=True)
class WeightFormatRecord:
    """Set as `weight_format` on a module whose weights came from a quantized checkpoint, so that
    compute code can tell what it holds: `checkpoint` how the checkpoint stored them, `memory` the
    dtype now in memory (e.g. MXFP4 experts dequantized at load: checkpoint mxfp4, memory bfloat16)."""

    checkpoint: WeightFormat
    memory: str
