"""Tiny random DeepSeek-V2 / V3 checkpoints written by transformers' own `save_pretrained`.

Shaped to exercise what differs from a plain transformer: a dense first layer then MoE layers
with shared experts and grouped top-k routing, q through a LoRA (V3) or a plain projection (V2),
YaRN rope with an attention factor and mscale (V3), a non-zero V3 routing correction bias.
The larger init range keeps logits far from ties, so greedy decoding has one right answer.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tests.tiny_models import EOS, VOCAB, tiny_tokenizer  # noqa: E402

COMMON = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=VOCAB, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.15, eos_token_id=EOS,
    bos_token_id=None, pad_token_id=None,
)  # fmt: skip
DEEPSEEK: dict[str, tuple[str, dict]] = {
    "deepseek_v2": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="group_limited_greedy",
                                             routed_scaling_factor=1.0)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        q_lora_rank=24, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.9, "mscale_all_dim": 1.0})),
}  # fmt: skip


def hf_deepseek(name: str, *, seed: int = 0, **overrides):
    """A fresh random HF DeepSeek model (float32, eval mode, eager attention); overrides: config
    fields, e.g. DeepSeek's real latent shape (kv_lora_rank=512, qk_rope_head_dim=64)."""
    import transformers

    cls_name, extra = DEEPSEEK[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:  # V3: a real checkpoint's bias is not zero; neither is ours
                bias.copy_(torch.randn(bias.shape) * 0.3)
    return model


def write_deepseek(path: Path, name: str, *, seed: int = 0, **overrides):
    """Save DeepSeek variant `name` with the tiny tokenizer to `path`; returns the HF model (oracle)."""
    model = hf_deepseek(name, seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save(str(Path(path) / "tokenizer.json"))
    return model


# DeepSeek-V3.2 (sparse MLA): V3 plus the lightning indexer; `index_topk` below most prompt lengths
# so that the indexer's choice matters. Many index heads keep index scores away from exact ties.
V32 = dict(DEEPSEEK["deepseek_v3"][1], index_n_heads=16, index_head_dim=16, index_topk=8)
V32.pop("rope_interleave")  # V3.2 always rotates MLA's rope by pairs (and the indexer's by halves)


def hf_deepseek_v32(*, seed: int = 0, **overrides):
    """A fresh random HF DeepseekV32ForCausalLM (float32, eval, eager); overrides e.g. index_topk."""
    import transformers

    config = transformers.DeepseekV32Config(**{**COMMON, **V32, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.3)
    return model


def write_deepseek_v32(path: Path, *, seed: int = 0, **overrides):
    """Save a tiny DeepSeek-V3.2 with the tiny tokenizer to `path`; returns the HF model (oracle)."""
    model = hf_deepseek_v32(seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save(str(Path(path) / "tokenizer.json"))
    return model
