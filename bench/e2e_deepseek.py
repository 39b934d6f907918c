"""A DeepSeek-V2-Lite-shaped checkpoint with random weights for bench/e2e.py (`--model
deepseek-v2-lite`) and bench/deepseek_graphs.py, and its decode roofline.

Shape (the config.json of deepseek-ai/DeepSeek-V2-Lite, as HF's DeepseekV2Config takes it):
27 layers, hidden 2048, 16 heads; multi-head latent attention with no q LoRA (q_proj straight to
16 x (128 nope + 64 rope)), a latent of kv_lora_rank 512 plus a shared rope key of 64, values of
128 per head; layer 0 dense (intermediate 10944), layers 1-26 MoE: a softmax router over 64
routed experts of 1408, greedy top-6 (one group), no renormalisation, scaling 1.0, plus 2 shared
experts (one MLP of 2 x 1408); vocabulary 102,400, untied LM head; YaRN rope (theta 10000,
factor 40 over 4096 original positions, beta 32 / 1, mscale = mscale_all_dim = 0.707; 163,840
positions). About 15.7 B parameters, 31.4 GB in bf16. `--layers N` keeps N layers (the first
dense); the roofline counts the layers written.

Roofline of one decode step at batch bs: every weight it must read once at the copy bandwidth
(per layer the MLA projections and their norms, the dense MLP or the router, the shared experts
and the routed experts the batch touches: 6 at bs 1, above that the expected number of distinct
experts of bs tokens routed uniformly at random; final norm and LM head; one embedding row per
token) plus the KV it reads: MLA caches one row of 512 + 64 per token and layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

DEEPSEEK_V2_LITE = dict(
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=102400,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=100000,
    eos_token_id=100001,
)  # fmt: skip
TINY_DEEPSEEK = {**DEEPSEEK_V2_LITE, **dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=512, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
    rope_parameters={**DEEPSEEK_V2_LITE["rope_parameters"], "factor": 4.0, "original_max_position_embeddings": 256},
)}  # fmt: skip


def with_layers(shape: dict, layers: int | None) -> dict:
    return shape if layers is None else {**shape, "num_hidden_layers": layers}


def write_checkpoint(path: Path, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> int:
    """Random weights under HF's names and layouts as released (one tensor per expert projection),
    one safetensors shard per layer, config.json by transformers' DeepseekV2Config; returns bytes.

    The names and shapes are those meshserve's DeepSeek model declares (built on the meta device);
    tests/unit/test_bench_deepseek.py checks that HF's own model loads them with none missing or left over.
    """
    import transformers

    from bench.common import save_shards
    from meshserve.workers.checkpoint import read_arch
    from meshserve.workers.loader import fused_parts, part_sizes
    from meshserve.workers.models.deepseek import DeepseekForCausalLM

    transformers.DeepseekV2Config(**shape, architectures=["DeepseekV2ForCausalLM"], dtype=dtype).save_pretrained(path)
    arch = read_arch(path)
    with torch.device("meta"):
        model = DeepseekForCausalLM(arch)
    fused = fused_parts(model.STACKED)
    g = torch.Generator(device).manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        layer = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        if "norm" in name:
            t = torch.ones(p.shape, dtype=dtype)
        else:
            t = (torch.randn(p.shape, generator=g, device=device) * 0.02).to(dtype).cpu()
        module = name.split(".")[-2]
        if module in fused:  # HF keeps the parts apart (gate/up; q_proj, kv_a_proj_with_mqa): the loader stacks them
            sizes = part_sizes(module, arch, 1, 1, t.shape[0])
            shards.setdefault(layer, {}).update({name.replace(f".{module}.", f".{part}."): rows.contiguous()
                                                 for part, rows in zip(fused[module], t.split(sizes))})  # fmt: skip
            continue
        shards.setdefault(layer, {})[name] = t
    return save_shards(path, list(shards.values()))


def touched_experts(shape: dict, batch: int) -> float:
    """Routed experts a decode step of `batch` tokens reads per MoE layer (bench/common.py)."""
    from bench.common import expected_distinct_experts

    return expected_distinct_experts(shape["n_routed_experts"], shape["num_experts_per_tok"], batch)


def _attention_params(shape: dict) -> int:
    """MLA's parameters in one layer: q (plain or through a LoRA), the latent and rope-key
    projection, the latent's norm, kv_b_proj (keys' nope part and values per head), o_proj."""
    h, heads, r = shape["hidden_size"], shape["num_attention_heads"], shape["kv_lora_rank"]
    nope, rope, v = shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]
    q_lora = shape["q_lora_rank"]
    q = heads * (nope + rope) * (h if q_lora is None else q_lora) + (0 if q_lora is None else h * q_lora + q_lora)
    return q + h * (r + rope) + r + r * heads * (nope + v) + heads * v * h


def weight_bytes(shape: dict, itemsize: int, *, routed_experts: float, embedding_rows: float) -> float:
    """Bytes of every weight, with `routed_experts` of each MoE layer's routed experts and
    `embedding_rows` rows of the embedding table (what a step reads of them)."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    expert = 3 * h * shape["moe_intermediate_size"]
    dense, layers = shape["first_k_dense_replace"], shape["num_hidden_layers"]
    moe = shape["n_routed_experts"] * h + shape["n_shared_experts"] * expert + routed_experts * expert
    per_layer = _attention_params(shape) + 2 * h
    params = (layers * per_layer + min(dense, layers) * 3 * h * shape["intermediate_size"]
              + max(layers - dense, 0) * moe + h + v * h + embedding_rows * h)  # fmt: skip
    return params * itemsize


def decode_weight_bytes(shape: dict, itemsize: int, batch: int = 1) -> float:
    """Weight bytes a decode step of `batch` tokens reads (see the module docstring)."""
    return weight_bytes(shape, itemsize, routed_experts=touched_experts(shape, batch), embedding_rows=batch)


def kv_read_bytes(shape: dict, itemsize: int, context: float) -> float:
    """KV bytes one sequence's decode step reads at `context` tokens: the latent and rope key of
    every cached token in every layer (the up-projections are in the weights)."""
    return shape["num_hidden_layers"] * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) * itemsize * context


def step_bytes(shape: dict, itemsize: int, batch: int, context: float) -> float:
    """Bytes one decode step of `batch` sequences at `context` tokens must move."""
    return decode_weight_bytes(shape, itemsize, batch) + batch * kv_read_bytes(shape, itemsize, context)


def prefill_flops(shape: dict, tokens: int) -> float:
    """Matmul FLOPs of a causal prefill: 2 per active weight per token (MLA projections, dense MLP
    or router + shared + top-k routed experts), the LM head for the last token, and attention as
    prefill computes it (keys and values expanded per head: QK^T over nope + rope, PV over v, the
    causal half)."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    expert = 3 * h * shape["moe_intermediate_size"]
    dense, layers = min(shape["first_k_dense_replace"], shape["num_hidden_layers"]), shape["num_hidden_layers"]
    moe = shape["n_routed_experts"] * h + (shape["n_shared_experts"] + shape["num_experts_per_tok"]) * expert
    active = layers * _attention_params(shape) + dense * 3 * h * shape["intermediate_size"] + (layers - dense) * moe
    qk, v = shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"], shape["v_head_dim"]
    attention = layers * tokens * tokens * heads * (qk + v)  # 2 FLOPs x T^2 / 2 pairs x H x (qk + v)
    return 2 * tokens * active + 2 * h * shape["vocab_size"] + attention
