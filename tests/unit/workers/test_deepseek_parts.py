"""DeepSeek's parts against HF transformers' own code: config parsing, YaRN tables, MoE routing."""

import pytest
import torch

from meshserve.errors import ConfigError
from meshserve.workers.models.arch import arch_from_hf_config
from meshserve.workers.models.moe import MoE
from meshserve.workers.models.rope import yarn_inverse_frequencies
from tests.deepseek_models import COMMON, DEEPSEEK, hf_deepseek


def config(name: str, **override) -> dict:
    import transformers

    cls_name, extra = DEEPSEEK[name]
    return getattr(transformers, cls_name)(**{**COMMON, **extra, **override}).to_dict() | {
        "architectures": [cls_name.replace("Config", "ForCausalLM")]}


def test_v3_config_becomes_architecture_data():
    arch = arch_from_hf_config(config("deepseek_v3"))
    ds = arch.deepseek
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 1, 24)
    assert (ds.mla.kv_lora_rank, ds.mla.q_lora_rank, ds.mla.qk_rope_head_dim) == (32, 24, 8)
    assert (ds.moe.scoring, ds.moe.group_by, ds.moe.norm_topk_prob, ds.moe.correction_bias) == (
        "sigmoid", "top2_sum", True, True)
    assert ds.rope.kind == "yarn" and ds.rope.interleaved and ds.moe.first_k_dense_replace == 1
    v2 = arch_from_hf_config(config("deepseek_v2")).deepseek
    assert (v2.moe.scoring, v2.moe.group_by, v2.mla.q_lora_rank) == ("softmax", "max", None)


@pytest.mark.parametrize(("override", "field"), [
    (dict(topk_method="noaux"), "topk_method"),
    (dict(n_group=3), "n_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(kv_lora_rank=None), "config.json:kv_lora_rank"),
])  # fmt: skip
def test_bad_configs_name_the_field(override, field):
    cfg = config("deepseek_v2")
    cfg.update(override)
    with pytest.raises(ConfigError) as err:
        arch_from_hf_config(cfg)
    assert err.value.field == field


def test_yarn_tables_match_hf():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = DeepseekV3Config(**{**COMMON, **DEEPSEEK["deepseek_v3"][1]})
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rope = arch_from_hf_config(config("deepseek_v3")).deepseek.rope
    got, factor = yarn_inverse_frequencies(rope, 8)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert factor == pytest.approx(want_factor) and factor != 1.0


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_moe_layer_matches_hf(name):
    hf = hf_deepseek(name, seed=3)
    hf_moe = hf.model.layers[1].mlp
    arch = arch_from_hf_config(config(name))
    moe = MoE(arch.hidden_size, arch.deepseek.moe)
    state = {k: v for k, v in hf.state_dict().items() if k.startswith("model.layers.1.mlp.")}
    hf_names = {k.removeprefix("model.layers.1.mlp."): v for k, v in state.items()}
    if "experts.gate_up_proj" in hf_names:  # transformers 5 keeps experts stacked in memory
        gate_up, down = hf_names.pop("experts.gate_up_proj"), hf_names.pop("experts.down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            hf_names[f"experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            hf_names[f"experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            hf_names[f"experts.{e}.down_proj.weight"] = down[e]
    for key in [k for k in hf_names if k.endswith("gate_proj.weight")]:  # our MLPs stack gate and up
        stem = key.removesuffix("gate_proj.weight")
        hf_names[f"{stem}gate_up_proj.weight"] = torch.cat((hf_names.pop(key), hf_names.pop(f"{stem}up_proj.weight")))
    missing = moe.load_state_dict(hf_names, strict=True)
    assert not missing.missing_keys
    x = torch.randn(9, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf_moe(x[None])[0], rtol=1e-5, atol=1e-6)
