"""Quantized loading: config errors, FP8 scales split with their weights under TP (and a clear
error when a split would cut a scale block), MXFP4 slices, the packed-MXFP4 seam for the MoE."""

import json

import pytest
import torch

from meshserve.errors import ConfigError
from meshserve.parallel.groups import ParallelContext
from meshserve.workers.checkpoint import Checkpoint, read_arch
from meshserve.workers.loader import load_model
from meshserve.workers.models import tensor_parallel_transform
from meshserve.workers.quant.formats import parse_quantization_config
from meshserve.workers.quant.layers import Fp8Linear
from meshserve.workers.quant.loading import QuantLoadError, read_quantized
from meshserve.workers.sharding import shard_of
from tests.quant_models import quantize_checkpoint
from tests.tiny_models import write_checkpoint

FP8_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(("qc", "match"), [
    ({"quant_method": "awq"}, r"quant_method.*\['fp8', 'mxfp4'\]"),
    ({**FP8_CFG, "weight_block_size": None}, "weight_block_size"),
    ({**FP8_CFG, "weight_block_size": [128, 100]}, "weight_block_size"),
    ({**FP8_CFG, "activation_scheme": "static"}, "activation_scheme"),
    ({**FP8_CFG, "fmt": "e5m2"}, "fmt"),
])
def test_bad_quantization_config_names_the_field(qc, match):
    with pytest.raises(ConfigError, match=match):
        parse_quantization_config({"quantization_config": qc})


def test_published_configs_parse():
    q = parse_quantization_config({"quantization_config": {**FP8_CFG, "modules_to_not_convert": ["lm_head"]}})
    assert (q.method, q.block, q.online, q.not_converted) == ("fp8", (128, 128), False, ("lm_head",))
    assert parse_quantization_config({}) is None


def test_unknown_quant_method_fails_before_loading(tmp_path):
    write_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="gptq.*one of"):
        read_arch(tmp_path)


def _rank_model(path, rank, tp):
    arch = read_arch(path)
    ctx = ParallelContext(rank=rank, tp=tp)
    return load_model(path, rank=rank, world=tp, progress=False,
                      transform=lambda m: tensor_parallel_transform(arch)(m, ctx))


def _deq(module):
    from meshserve.workers.quant.fp8 import dequantize_fp8_block

    return dequantize_fp8_block(module.weight, module.weight_scale_inv, module.block)


@pytest.fixture(scope="module")
def fp8_16(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8tp")
    write_checkpoint(root / "float", "llama")
    quantize_checkpoint(root / "float", root / "quant", "fp8", block=(16, 16))
    return root / "quant"


def test_tp_ranks_hold_their_slices_of_weights_and_scales(fp8_16):
    full = load_model(fp8_16, progress=False)
    ranks = [_rank_model(fp8_16, r, 2) for r in range(2)]
    for i in range(2):
        def attn(m, i=i):
            return m.model.layers[i].self_attn

        def mlp(m, i=i):
            return m.model.layers[i].mlp

        q, k, v = _deq(attn(full).qkv_proj).split([64, 32, 32])
        gate, up = _deq(mlp(full).gate_up_proj).split([128, 128])
        for r, part in enumerate(ranks):
            assert isinstance(attn(part).o_proj, Fp8Linear) and attn(part).o_proj.ctx.tp == 2
            qkv = torch.cat([q[r * 32:(r + 1) * 32], k[r * 16:(r + 1) * 16], v[r * 16:(r + 1) * 16]])
            torch.testing.assert_close(_deq(attn(part).qkv_proj), qkv, rtol=0, atol=0)
            torch.testing.assert_close(_deq(attn(part).o_proj), _deq(attn(full).o_proj)[:, r * 32:(r + 1) * 32],
                                       rtol=0, atol=0)
            torch.testing.assert_close(_deq(mlp(part).gate_up_proj),
                                       torch.cat([gate[r * 64:(r + 1) * 64], up[r * 64:(r + 1) * 64]]), rtol=0, atol=0)
            assert attn(part).qkv_proj.weight_scale_inv.shape == (4, 4)


def test_tp_split_that_cuts_a_scale_block_is_refused_naming_working_tp(tmp_path):
    write_checkpoint(tmp_path / "float", "llama")
    quantize_checkpoint(tmp_path / "float", tmp_path / "quant", "fp8", block=(32, 32))
    # k_proj has 2 heads x 16 rows: tp=2 gives each rank 16 rows of a 32-row scale block.
    with pytest.raises(QuantLoadError, match=r"tp=2 would cut a \(32, 32\) FP8 scale block of '.*k_proj.weight'"
                                             r".*tp values that work for it: \[1\]"):
        _rank_model(tmp_path / "quant", 0, 2)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    write_checkpoint(root / "float", "gpt_oss")
    quantize_checkpoint(root / "float", root / "quant", "mxfp4")
    return root / "quant"


def test_mxfp4_packed_seam_and_group_cut_error(gpt_oss_mxfp4):
    arch = read_arch(gpt_oss_mxfp4)
    quant = parse_quantization_config(json.loads((gpt_oss_mxfp4 / "config.json").read_text()))

    def shard_fn(name, shape, world, rank):
        return shard_of(name, shape, arch, rank, world)

    with Checkpoint(gpt_oss_mxfp4) as ckpt:
        names = set(ckpt.names())
        name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
        blocks = ckpt.read(name)
        assert blocks.shape == (4, 64, 2, 16) and blocks.dtype == torch.uint8  # [E, 2I, hidden / 32, 16]
        packed = read_quantized(ckpt, name, names, quant=quant, dest=torch.empty(0, dtype=torch.uint8), world=2,
                                rank=1, shard_fn=shard_fn)
        assert torch.equal(packed.values, blocks[:, 32:])  # rank 1: the second half of 2I, still packed
        assert torch.equal(packed.scale, ckpt.read("model.layers.0.mlp.experts.gate_up_proj_scales")[:, 32:])
        # down_proj [E, hidden, I / 32, 16] with I = 32: tp=2 gives each rank half a group. Kept
        # packed that cannot be split; dequantized at load, each rank keeps its 16 input features.
        down = "model.layers.0.mlp.experts.down_proj_blocks"
        cut = r"tp=2 would cut a 32-value MXFP4 group.*down_proj.*work for it: \[1\]"
        with pytest.raises(QuantLoadError, match=cut):
            read_quantized(ckpt, down, names, quant=quant, dest=torch.empty(0, dtype=torch.uint8), world=2,
                           rank=0, shard_fn=shard_fn)
        whole = read_quantized(ckpt, down, names, quant=quant, dest=torch.empty(0), world=1, rank=0,
                               shard_fn=shard_fn).values  # [E, I, hidden]
        for rank in range(2):
            part = read_quantized(ckpt, down, names, quant=quant, dest=torch.empty(0), world=2, rank=rank,
                                  shard_fn=shard_fn).values
            assert torch.equal(part, whole[:, rank * 16:(rank + 1) * 16])


def test_deepseek_mtp_layer_is_skipped_only_when_the_config_declares_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from meshserve.workers.loader import WeightError
    from tests.deepseek_models import write_deepseek

    write_deepseek(tmp_path / "float", "deepseek_v3")
    quantize_checkpoint(tmp_path / "float", tmp_path / "quant", "fp8")
    path = tmp_path / "quant"
    state = load_file(path / "model.safetensors")
    # As in the V3/R1 releases: layer num_hidden_layers holds the MTP module (FP8 like the rest).
    state["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128).to(torch.float8_e4m3fn)
    state["model.layers.2.eh_proj.weight_scale_inv"] = torch.ones(1, 1)
    state["model.layers.2.enorm.weight"] = torch.ones(64)
    save_file(state, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1  # HF's DeepseekV3Config default, as released
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(WeightError, match="model.layers.2.*has no place"):
        load_model(path, progress=False)
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path, progress=False)
    assert len(model.model.layers) == 2


def test_deepseek_fp8_tp_slices_mla_and_experts(tmp_path):
    """MLA projections (column, row, and kv_b_proj dequantized at load), routed and shared experts:
    each TP rank's (dequantized) weights are its slices of the whole model's."""
    from tests.deepseek_models import write_deepseek

    write_deepseek(tmp_path / "float", "deepseek_v3")
    quantize_checkpoint(tmp_path / "float", tmp_path / "quant", "fp8", block=(16, 16))
    full = load_model(tmp_path / "quant", progress=False)
    f_attn, f_moe = full.model.layers[1].self_attn, full.model.layers[1].mlp
    assert isinstance(f_attn.q_b_proj, Fp8Linear) and f_attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (3, 4)
    assert f_attn.q_kv_a_proj is None  # q_a_proj's 24 rows end inside a 16-row block: two linears
    for r in range(2):
        part = _rank_model(tmp_path / "quant", r, 2)
        attn, moe = part.model.layers[1].self_attn, part.model.layers[1].mlp
        rows = slice(r * 48, (r + 1) * 48)  # 2 of 4 heads x (16 nope + 8 rope)
        torch.testing.assert_close(_deq(attn.q_b_proj), _deq(f_attn.q_b_proj)[rows], rtol=0, atol=0)
        torch.testing.assert_close(_deq(attn.o_proj), _deq(f_attn.o_proj)[:, r * 32:(r + 1) * 32], rtol=0, atol=0)
        torch.testing.assert_close(attn.kv_b_proj.weight, f_attn.kv_b_proj.weight[r * 64:(r + 1) * 64], rtol=0, atol=0)
        torch.testing.assert_close(_deq(attn.kv_a_proj_with_mqa), _deq(f_attn.kv_a_proj_with_mqa), rtol=0, atol=0)
        for e in (0, 7):  # gate_up [2I, hidden]: a rank holds its slice of gate, then of up (16-row blocks)
            gate, _ = _deq(moe.experts[e].gate_up_proj).chunk(2)
            torch.testing.assert_close(gate, _deq(f_moe.experts[e].gate_up_proj).chunk(2)[0][r * 16:(r + 1) * 16],
                                       rtol=0, atol=0)
            torch.testing.assert_close(_deq(moe.experts[e].down_proj),
                                       _deq(f_moe.experts[e].down_proj)[:, r * 16:(r + 1) * 16], rtol=0, atol=0)
        _, up = _deq(moe.shared_experts.gate_up_proj).chunk(2)
        torch.testing.assert_close(up, _deq(f_moe.shared_experts.gate_up_proj).chunk(2)[1][r * 16:(r + 1) * 16],
                                   rtol=0, atol=0)
