"""A GPT-OSS-20B-shaped checkpoint with random weights for bench/e2e.py (`--model gpt-oss-20b`),
and its decode roofline.

Shape (HF GptOssConfig of openai/gpt-oss-20b, bf16 instead of the released MXFP4 experts):
24 layers alternating sliding (window 128) and full attention, hidden 2880, 64 query heads and
8 KV heads of 64, learned sinks, biases on q/k/v/o, 32 experts of 2880 (clamped SwiGLU with
biases), top-4, vocabulary 201,088, YaRN rope. `--layers N` keeps N layers (the same
alternation) when 24 do not fit a sensible start-up: the roofline counts the layers written.
At 24 layers the bf16 checkpoint is about 41.8 GB on disk and in GPU memory.

Roofline of one decode step at batch bs: every weight it must read once at the copy bandwidth
(attention projections, router, and per layer the experts the batch touches: 4 at bs 1, the
expected number of distinct experts of bs tokens routed uniformly at random above; final norm
and LM head; one embedding row per token) plus the KV it reads (full layers: the context;
sliding layers: at most the window).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GPT_OSS_20B = dict(
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    vocab_size=201088,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
)  # fmt: skip
TINY_GPT_OSS = {**GPT_OSS_20B, **dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                      vocab_size=512, sliding_window=8, max_position_embeddings=512)}  # fmt: skip


def with_layers(shape: dict, layers: int | None) -> dict:
    return shape if layers is None else {**shape, "num_hidden_layers": layers}


def layer_types(shape: dict) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape["num_hidden_layers"])]


def write_checkpoint(path: Path, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> int:
    """Random GPT-OSS weights (HF names and layouts), one safetensors shard per layer; returns bytes."""
    from bench.common import save_shards

    g = torch.Generator(device).manual_seed(seed)
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv, e = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"], \
        shape["num_local_experts"]  # fmt: skip

    def rand(*size: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * scale).to(dtype).cpu()

    shards = [{"model.embed_tokens.weight": rand(v, h)}]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shards.append({
            f"{p}.self_attn.sinks": rand(shape["num_attention_heads"], scale=1.0),
            **{f"{p}.self_attn.{n}_proj.weight": rand(o, h) for n, o in (("q", q), ("k", kv), ("v", kv))},
            **{f"{p}.self_attn.{n}_proj.bias": rand(o) for n, o in (("q", q), ("k", kv), ("v", kv), ("o", h))},
            f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.mlp.router.weight": rand(e, h),
            f"{p}.mlp.router.bias": rand(e),
            f"{p}.mlp.experts.gate_up_proj": rand(e, h, 2 * inter),
            f"{p}.mlp.experts.gate_up_proj_bias": rand(e, 2 * inter),
            f"{p}.mlp.experts.down_proj": rand(e, inter, h),
            f"{p}.mlp.experts.down_proj_bias": rand(e, h),
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=dtype),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })  # fmt: skip
    shards.append({"model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": rand(v, h)})
    total = save_shards(path, shards)
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "torch_dtype": str(dtype)[6:],
              "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": True, "bos_token_id": 1,
              "eos_token_id": 2, "layer_types": layer_types(shape), **shape}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return total


def touched_experts(shape: dict, batch: int) -> float:
    """Experts a decode step of `batch` tokens reads per layer (bench/common.py)."""
    from bench.common import expected_distinct_experts

    return expected_distinct_experts(shape["num_local_experts"], shape["num_experts_per_tok"], batch)


def decode_weight_bytes(shape: dict, itemsize: int, batch: int = 1) -> float:
    """Weight bytes a decode step of `batch` tokens reads (see the module docstring)."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv, e = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"], \
        shape["num_local_experts"]  # fmt: skip
    attention = 2 * q * h + 2 * kv * h + (q + 2 * kv + h) + shape["num_attention_heads"] + 2 * h
    expert = 3 * h * inter + 2 * inter + h
    layer = attention + e * h + e + touched_experts(shape, batch) * expert
    return (shape["num_hidden_layers"] * layer + h + v * h + batch * h) * itemsize


def kv_read_bytes(shape: dict, itemsize: int, context: float) -> float:
    """KV bytes one sequence's decode step reads at `context` tokens (sliding layers: the window)."""
    per_token_layer = 2 * shape["num_key_value_heads"] * shape["head_dim"] * itemsize
    window = shape["sliding_window"]
    return sum(per_token_layer * (min(context, window) if t == "sliding_attention" else context)
               for t in layer_types(shape))  # fmt: skip


def prefill_flops(shape: dict, tokens: int) -> float:
    """Matmul FLOPs of a causal prefill: 2 per active weight per token, plus QK^T and PV (full
    layers over the causal half, sliding layers over at most the window)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    active = 2 * q * h + 2 * kv * h + shape["num_local_experts"] * h + shape["num_experts_per_tok"] * 3 * h * inter
    attention = sum(2 * tokens * q * (tokens if t == "full_attention" else 2 * min(tokens, shape["sliding_window"]))
                    for t in layer_types(shape))  # fmt: skip
    return 2 * tokens * (shape["num_hidden_layers"] * active + h * shape["vocab_size"] / tokens) + attention


def step_bytes(shape: dict, itemsize: int, batch: int, context: float) -> float:
    """Bytes one decode step of `batch` sequences at `context` tokens must move."""
    return decode_weight_bytes(shape, itemsize, batch) + batch * kv_read_bytes(shape, itemsize, context)
