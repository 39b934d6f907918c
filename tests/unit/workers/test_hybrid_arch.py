"""Gemma2 / Gemma3 / GPT-OSS config parsing: defaults as HF applies them, bad values named."""

import pytest

from meshserve.errors import ConfigError
from meshserve.workers.models.arch import arch_from_hf_config

BASE = dict(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def test_gemma2_defaults_alternate_windows_and_take_its_scale():
    arch = arch_from_hf_config({"architectures": ["Gemma2ForCausalLM"], **BASE, "sliding_window": 8,
                                "query_pre_attn_scalar": 144, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0})
    assert arch.layer_windows == (8, None, 8, None)  # HF: even layers slide
    assert arch.attn_scale == 144 ** -0.5 and arch.embed_scale == 8.0 and arch.tie_word_embeddings
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.norm_unit_offset and arch.sandwich_norms


def test_gemma3_legacy_config_has_a_local_rope_base_and_every_sixth_layer_full():
    arch = arch_from_hf_config({"architectures": ["Gemma3ForCausalLM"], **BASE, "num_hidden_layers": 6,
                                "sliding_window": 8, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert arch.layer_windows == (8, 8, 8, 8, 8, None)
    assert (arch.rope.theta, arch.local_rope.theta, arch.attn_soft_cap, arch.qk_norm) == (1e6, 1e4, None, True)


def test_gpt_oss_yarn_and_experts():
    arch = arch_from_hf_config({"architectures": ["GptOssForCausalLM"], **BASE, "sliding_window": 8,
                                "num_local_experts": 4, "num_experts_per_tok": 2,
                                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0,
                                                    "original_max_position_embeddings": 4096, "truncate": False}})
    assert arch.attn_sinks and arch.qkv_bias and arch.o_bias and arch.layer_windows == (8, None, 8, None)
    assert (arch.rope.kind, arch.rope.truncate, arch.experts.top_k) == ("yarn", False, 2)


@pytest.mark.parametrize(("extra", "field"), [
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_local_experts": 0, "num_experts_per_tok": 1}, "num_local_experts"),
    ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, "sliding_window"),
    ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
      "quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
      "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
])
def test_gpt_oss_bad_values_are_named(extra, field):
    with pytest.raises(ConfigError, match=field):
        arch_from_hf_config({"architectures": ["GptOssForCausalLM"], **BASE, **extra})


def test_gemma2_bad_soft_cap_is_named():
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        arch_from_hf_config({"architectures": ["Gemma2ForCausalLM"], **BASE, "sliding_window": 8,
                             "attn_logit_softcapping": -1.0})
