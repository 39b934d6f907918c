"""bench/e2e_gptoss.py against HF transformers' own GPT-OSS: the random checkpoint has exactly the
parameters HF's model declares (names and shapes), and the bs-1 decode roofline counts exactly
the parameters a step reads (HF's, minus the experts not chosen and all but one embedding row)."""

import pytest
import torch

from bench import e2e_gptoss

transformers = pytest.importorskip("transformers")


def _hf_config(shape: dict):
    return transformers.GptOssConfig(**shape, layer_types=e2e_gptoss.layer_types(shape), attention_bias=True)


def test_random_checkpoint_loads_into_hf_without_missing_or_unexpected_weights(tmp_path):
    shape = e2e_gptoss.TINY_GPT_OSS
    e2e_gptoss.write_checkpoint(tmp_path, shape, torch.float32, "cpu")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert model.config.num_local_experts == shape["num_local_experts"]


@pytest.mark.parametrize("layers", [24, 6])
def test_bs1_roofline_counts_the_parameters_a_decode_step_reads(layers):
    shape = e2e_gptoss.with_layers(e2e_gptoss.GPT_OSS_20B, layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(shape))
    unread = 0  # the embedding table but one row, and the experts a token does not choose
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            unread += p.numel() - p.shape[1]
        elif ".mlp.experts." in name:
            unread += p.numel() * (shape["num_local_experts"] - shape["num_experts_per_tok"]) // p.shape[0]
    read = sum(p.numel() for p in model.parameters()) - unread
    assert e2e_gptoss.decode_weight_bytes(shape, 2, 1) == 2 * read
    if layers == 24:  # the published size: about 21 B parameters, 3.6 B active per token
        assert 20.5e9 < sum(p.numel() for p in model.parameters()) < 21.5e9
