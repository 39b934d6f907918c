"""Loader: sharded checkpoints, dtype casts, tensor-parallel slices, errors that name the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshserve.errors import ConfigError
from meshserve.workers.checkpoint import Checkpoint, read_arch
from meshserve.workers.loader import WeightError, load_model
from meshserve.workers.sharding import Split, place_expert, shard_of, split_of
from tests.tiny_models import write_checkpoint


def _state(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


def _fused_equal(ours, hf_state, arch):
    """Our fused q/k/v and gate/up rows are the HF tensors stacked in order."""
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        qkv = torch.cat([hf_state[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"])
        torch.testing.assert_close(ours[f"{p}.self_attn.qkv_proj.weight"], qkv, rtol=0, atol=0)
        gate_up = torch.cat([hf_state[f"{p}.mlp.gate_proj.weight"], hf_state[f"{p}.mlp.up_proj.weight"]])
        torch.testing.assert_close(ours[f"{p}.mlp.gate_up_proj.weight"], gate_up, rtol=0, atol=0)


def test_sharded_index_checkpoint_loads_every_tensor(tmp_path):
    hf = write_checkpoint(tmp_path, "qwen2", max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(tmp_path, progress=False)
    ours, ref = _state(model), _state(hf)
    _fused_equal(ours, ref, model.arch)
    torch.testing.assert_close(ours["model.layers.1.self_attn.qkv_proj.bias"],
                               torch.cat([ref[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]))
    torch.testing.assert_close(ours["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])


def test_dtype_cast_and_tied_embeddings(tmp_path):
    hf = write_checkpoint(tmp_path, "llama")
    model = load_model(tmp_path, dtype="bfloat16", progress=False)
    assert model.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight.detach().bfloat16())
    # a tied checkpoint: no lm_head tensor, the embedding serves both
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    tied = load_model(tmp_path, progress=False)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


def _edit(tmp_path, src, edit):
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path, checkpoints):
    _edit(tmp_path, checkpoints["llama"][0], lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(tmp_path, progress=False)


def test_wrong_shape_is_named(tmp_path, checkpoints):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :100].clone()

    _edit(tmp_path, checkpoints["llama"][0], shrink)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(64, 100\).*\(64, 128\)"):
        load_model(tmp_path, progress=False)


def test_unexpected_tensor_is_named(tmp_path, checkpoints):
    _edit(tmp_path, checkpoints["qwen3"][0], lambda t: t.__setitem__("model.layers.0.extra.weight", torch.ones(2)))
    with pytest.raises(WeightError, match=r"model\.layers\.0\.extra\.weight"):
        load_model(tmp_path, progress=False)


def test_bad_config_is_refused_naming_field(tmp_path, checkpoints):
    shutil.copytree(checkpoints["llama"][0], tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="architectures.*LlamaForCausalLM"):
        read_arch(tmp_path)
    with pytest.raises(ConfigError, match="model"):
        read_arch(tmp_path / "nowhere")


@pytest.mark.parametrize("world", [2, 4])
def test_tp_slices_reassemble_the_full_tensors(checkpoints, world):
    """Per-rank slices of every tensor concatenate back to the checkpoint tensor (KV heads
    replicated when there are fewer than ranks)."""
    path, _ = checkpoints["qwen2"]
    arch = read_arch(path)
    with Checkpoint(path) as ckpt:
        for name in ckpt.names():
            full = ckpt.read(name)
            parts = []
            for rank in range(world):
                shard = shard_of(name, tuple(full.shape), arch, rank, world)
                parts.append(ckpt.read(name, shard.dim, shard.start, shard.stop))
            split = split_of(name)
            if split is Split.REPLICATED:
                assert all(torch.equal(p, full) for p in parts), name
            elif split is Split.KV_COLUMN and arch.num_kv_heads < world:
                per = world // arch.num_kv_heads
                torch.testing.assert_close(torch.cat(parts[::per]), full, rtol=0, atol=0)
                assert all(torch.equal(parts[r], parts[r - r % per]) for r in range(world)), name
            else:
                torch.testing.assert_close(torch.cat(parts, dim=1 if split is Split.ROW else 0), full,
                                           rtol=0, atol=0)


def test_tp_needs_a_divisible_model(checkpoints):
    arch = read_arch(checkpoints["qwen2"][0])
    with pytest.raises(ConfigError, match="tp"):
        shard_of("model.layers.0.mlp.gate_proj.weight", (128, 64), arch, 0, 3)
    with pytest.raises(ConfigError, match="rank"):
        shard_of("model.layers.0.mlp.gate_proj.weight", (128, 64), arch, 2, 2)


def test_expert_parallel_places_each_expert_on_one_rank_of_each_group(tmp_path):
    """tp=4, ep=2: EP rank r % 2 holds half the experts, sliced two ways across the groups; the
    pieces reassemble the checkpoint tensor; DeepSeek's per-expert modules are renumbered."""
    from tests.deepseek_models import write_deepseek
    from tests.tiny_models import write_checkpoint as write

    write(tmp_path / "gpt_oss", "gpt_oss")
    arch = read_arch(tmp_path / "gpt_oss")
    with Checkpoint(tmp_path / "gpt_oss") as ckpt:
        for kind in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            name = f"model.layers.0.mlp.experts.{kind}"
            full = ckpt.read(name)
            pieces = {r: ckpt.read_box(name, place_expert(name, tuple(full.shape), arch, r, 4, 2).box)
                      for r in range(4)}  # fmt: skip
            for ep_rank in range(2):
                group = [pieces[ep_rank], pieces[ep_rank + 2]]  # the same experts, two feature slices
                if kind == "down_proj_bias":
                    assert torch.equal(group[0], group[1])
                    group = group[:1]
                whole = torch.cat(group, dim=1 if kind == "down_proj" else -1)
                assert torch.equal(whole, full[ep_rank * 2 : ep_rank * 2 + 2]), kind
    assert place_expert("model.layers.0.self_attn.q_proj.weight", (64, 64), arch, 0, 4, 2) is None
    write_deepseek(tmp_path / "ds", "deepseek_v3")
    ds = read_arch(tmp_path / "ds")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert place_expert(name, (32, 64), ds, 0, 2, 2).target is None  # experts 0-3 live on rank 0
    here = place_expert(name, (32, 64), ds, 1, 2, 2)
    assert here.target == "model.layers.1.mlp.experts.1.up_proj.weight" and here.box == {}
    assert place_expert(name, (32, 64), ds, 3, 4, 2).box == {0: (16, 32)}  # second feature slice
    with pytest.raises(ConfigError, match="ep"):
        place_expert(name, (32, 64), ds, 0, 3, 3)  # 8 experts over 3 ranks
