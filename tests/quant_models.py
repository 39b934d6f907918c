"""Tiny quantized checkpoints in the published layouts, and their dequantized twins (the oracle).

`quantize_checkpoint(src, dst, ...)` rewrites a float checkpoint written by HF's save_pretrained:
- "fp8": every projection weight of the decoder layers (attention, dense MLP, routed and shared
  experts) as float8_e4m3fn `weight` + float32 `weight_scale_inv` [ceil(out / bn), ceil(in / bk)],
  config `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
  "dynamic", "weight_block_size": [bn, bk]}` (DeepSeek-V3 / Qwen3-FP8); embeddings, LM head, norms
  and router gates stay float, as released.
- "mxfp4": GPT-OSS experts as `*_blocks` uint8 [E, out, in / 32, 16] + `*_scales` uint8 [E, out, in / 32],
  `quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}` (gpt-oss-20b's).
It also writes `dst_dequantized`: the same weights dequantized in float64 and stored float32,
which HF transformers (and meshserve) load as a plain float checkpoint. The quantizers and
dequantizers here are written independently of meshserve's, element by element from the spec.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# DeepSeek-V3.2's indexer as released: wq_b and wk in FP8, weights_proj kept in high precision.
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*"
                       r"((?<!weights_)proj|proj_with_mqa|indexer\.wq_b|indexer\.wk)\.weight$")


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)], dequantized float64 [N, K]), block by block."""
    bn, bk = block
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float32)
    deq = torch.empty(n, k, dtype=torch.float64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = torch.tensor(max(tile.abs().max().item() / FP8_MAX, 1e-12), dtype=torch.float32)
            qt = (tile / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt
            scales[i, j] = s
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt.double() * s.double()
    return q, scales, deq


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., out, K] -> (blocks uint8 [..., out, K/32, 16], scales uint8 [..., out, K/32], dequantized float64)."""
    groups = w.double().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    mags = torch.tensor(E2M1, dtype=torch.float64)
    idx = (scaled.abs()[..., None] - mags).abs().argmin(-1)
    code = idx + 8 * (scaled < 0)
    deq = mags[idx] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exp)[..., None]
    pairs = code.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exp + 127).to(torch.uint8), deq.flatten(-2)


def quantize_checkpoint(src: Path, dst: Path, fmt: str, *, block: tuple[int, int] = (128, 128)) -> Path:
    """Write `dst` (quantized) and `dst`_dequantized (float32 twin) from float checkpoint `src`."""
    src, dst = Path(src), Path(dst)
    deq_dir = dst.with_name(dst.name + "_dequantized")
    for d in (dst, deq_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
        for f in d.glob("*.safetensors*"):
            f.unlink()
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    quant, plain = {}, {}
    for name, t in state.items():
        if fmt == "fp8" and QUANTIZED.match(name) and t.dim() == 2:
            q, s, deq = fp8_block(t, block)
            quant[name], quant[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            plain[name] = deq.float()
        elif fmt == "mxfp4" and re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$", name):
            blocks, scales, deq = mxfp4(t.transpose(1, 2))  # HF float layout [E, in, out] -> [E, out, in]
            quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
            plain[name] = deq.transpose(1, 2).float().contiguous()
        else:
            quant[name] = plain[name] = t
    save_file(quant, str(dst / "model.safetensors"))
    save_file(plain, str(deq_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
    else:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return deq_dir


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scale [N] = row amax / 448, dequantized float64 [N, K])."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.double() * scale.double()[:, None]


def online_fp8_twin(src: Path, dst: Path, *, projections: bool = True, lm_head: bool = False) -> Path:
    """`dst`: float checkpoint `src` with each decoder projection (`projections`) and/or the LM head
    (`lm_head`: ModelConfig.quantize_lm_head) replaced by its per-output-channel FP8 round trip
    (scale = row amax / 448), in float64 then stored float32: what online FP8 serves. A tied
    checkpoint's twin is untied: its head is the embedding's round trip, its embedding unchanged."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    for name, t in state.items():
        if projections and QUANTIZED.match(name) and t.dim() == 2:
            state[name] = fp8_per_channel(t)[2].float()
    if lm_head:
        config = json.loads((src / "config.json").read_text())
        head = state["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else state["lm_head.weight"]
        state["lm_head.weight"] = fp8_per_channel(head)[2].float()
        (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file(state, str(dst / "model.safetensors"))
    return dst
