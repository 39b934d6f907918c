"""bench/e2e_deepseek.py against independent oracles: HF transformers' own DeepSeek-V2 loads the
random checkpoint with no weight missing or left over; the roofline's weight bytes equal the
tensor bytes the checkpoint's safetensors files hold (every expert counted, one embedding row);
the bs-1 roofline counts exactly HF's parameters minus the experts not chosen."""

import json
import struct
from pathlib import Path

import pytest
import torch

from bench import e2e_deepseek

transformers = pytest.importorskip("transformers")


def _tensor_bytes(folder: Path) -> dict[str, int]:
    """Bytes of each tensor in the folder's safetensors files, read from the files' own headers
    (8-byte length, JSON with each tensor's data offsets)."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                out[name] = end - start
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_deepseek")
    e2e_deepseek.write_checkpoint(path, e2e_deepseek.TINY_DEEPSEEK, torch.float32, "cpu")
    return path


def test_random_checkpoint_loads_into_hf_without_missing_or_unexpected_weights(tiny_checkpoint):
    shape = e2e_deepseek.TINY_DEEPSEEK
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    cfg = model.config
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.first_k_dense_replace, cfg.q_lora_rank) == (
        shape["n_routed_experts"], shape["num_experts_per_tok"], 1, None)
    assert cfg.rope_parameters["rope_type"] == "yarn"


def test_weight_bytes_with_every_expert_equal_the_checkpoint_files(tiny_checkpoint):
    shape, itemsize = e2e_deepseek.TINY_DEEPSEEK, 4
    sizes = _tensor_bytes(tiny_checkpoint)
    assert any(".mlp.experts.7." in n for n in sizes) and any(".mlp.shared_experts." in n for n in sizes)
    one_row = shape["hidden_size"] * itemsize  # a bs-1 step reads one row of the embedding table
    read_at_bs1 = sum(sizes.values()) - sizes["model.embed_tokens.weight"] + one_row
    counted = e2e_deepseek.weight_bytes(shape, itemsize, routed_experts=shape["n_routed_experts"], embedding_rows=1)
    assert counted == read_at_bs1


@pytest.mark.parametrize("q_lora_rank", [None, 1536])
def test_bs1_roofline_counts_the_parameters_a_decode_step_reads(q_lora_rank):
    shape = {**e2e_deepseek.DEEPSEEK_V2_LITE, "q_lora_rank": q_lora_rank}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV2Config(**shape))
    unread = 0  # the embedding table but one row, and the routed experts a token does not choose
    e, k = shape["n_routed_experts"], shape["num_experts_per_tok"]
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            unread += p.numel() - p.shape[1]
        elif ".mlp.experts." in name:  # HF fuses each layer's experts into [E, ...] tensors
            assert p.shape[0] == e, name
            unread += p.numel() * (e - k) // e
    total = sum(p.numel() for p in model.parameters())
    assert e2e_deepseek.decode_weight_bytes(shape, 2, 1) == 2 * (total - unread)
    if q_lora_rank is None:  # the published size of DeepSeek-V2-Lite: 15.7 B parameters, 2.4 B active
        assert 15.6e9 < total < 15.8e9
        assert 2.3e9 < e2e_deepseek.weight_bytes(shape, 1, routed_experts=k, embedding_rows=0) < 2.5e9


def test_touched_experts_grow_from_top_k_to_every_expert():
    shape = e2e_deepseek.DEEPSEEK_V2_LITE
    touched = [e2e_deepseek.touched_experts(shape, bs) for bs in (1, 2, 64, 256)]
    # the second token's 6 experts are each new with probability 58 / 64
    assert touched[0] == 6 and touched[1] == pytest.approx(6 + 6 * 58 / 64)
    assert 63 < touched[2] < touched[3] <= 64
