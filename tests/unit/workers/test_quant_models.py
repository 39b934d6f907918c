"""Quantized checkpoints end to end on CPU: FP8 block-scaled (Llama, Qwen3, DeepSeek-V3 MLA + MoE),
GPT-OSS MXFP4 experts, online FP8.

The oracles: the same weights dequantized in float64 (tests/quant_models.py, written apart from
meshserve's quantization code) run by HF transformers' own model and by meshserve, and HF
transformers loading the quantized checkpoint itself (on CPU it dequantizes; needs accelerate).
The CPU path dequantizes exactly, so logits agree to float32 rounding and greedy tokens are
identical. HF's CPU FP8 dequantization derives the block from the scale grid (rows // scale
rows), which is wrong for a partial edge block (40 rows in blocks of 32 become two of 20): the
checkpoints here keep every dimension a whole number of blocks or a single block, where it is right.
"""

import json
from pathlib import Path

import pytest
import torch

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig
from meshserve.errors import ConfigError
from meshserve.workers.quant.formats import WeightFormat
from meshserve.workers.quant.layers import Fp8Linear, StreamedLinear
from meshserve.workers.step import NewRequest, ScheduledSeq, StepPlan
from meshserve.workers.worker import Worker
from tests.deepseek_models import write_deepseek, write_deepseek_v32
from tests.quant_models import online_fp8_twin, quantize_checkpoint
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

NEW_TOKENS = 6
# Qwen3 at the published 128x128 blocks needs q/k/v/gate/up row counts that are multiples of 128.
QWEN3_128 = dict(hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=384)


def _run(path, prompt, quantization="none", small_m_gemm="auto"):
    """Greedy-decode NEW_TOKENS tokens of one prompt: (logits of each step [NEW_TOKENS, V], tokens, model)."""
    w = Worker(ModelConfig(model=str(path), max_model_len=64, quantization=quantization, small_m_gemm=small_m_gemm),
               CacheConfig(block_size=4, num_kv_blocks=64), AttentionConfig(backend="TORCH"), device="cpu",
               progress=False)
    w.start()
    model, seen = w.runner.model, []
    original = model.compute_logits
    model.compute_logits = lambda h: seen.append(original(h)) or seen[-1]
    groups = w.kv_layout.num_groups  # GPT-OSS: sliding and full layers keep separate tables
    tables = [list(range(1 + g * 20, 21 + g * 20)) for g in range(groups)]
    new = [NewRequest("r", prompt, {"temperature": 0.0})]
    tokens, context, step_tokens = [], 0, prompt
    for step in range(NEW_TOKENS):
        out = w.runner.execute(StepPlan.from_seqs(step, [ScheduledSeq("r", step_tokens, context, tables)], new))
        new, context = [], context + len(step_tokens)
        tokens.append(out.sampled[0].token_id)
        step_tokens = [tokens[-1]]
    return torch.cat([s[-1:] for s in seen]), tokens, model


def _hf_logits(hf_dir, prompt, tokens):
    import transformers

    # HF's MXFP4 loader fetches Triton kernels from the hub whenever the `kernels` package imports
    # (transformers 5.x); nothing can be fetched here, and the oracle must not depend on what a hub
    # cache holds: dequantize=True takes HF's own CPU dequantization path, with no kernel loading.
    quant = json.loads((Path(hf_dir) / "config.json").read_text()).get("quantization_config", {})
    extra = ({"quantization_config": transformers.Mxfp4Config(dequantize=True)}
             if quant.get("quant_method") == "mxfp4" else {})
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation="eager", **extra).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) - 1 + NEW_TOKENS]
    return logits, hf_greedy(hf, prompt, NEW_TOKENS, eos=-1)


CASES = {
    "llama_fp8_32": lambda p: (write_checkpoint(p, "llama"), "fp8", (32, 32)),
    "qwen3_fp8_128": lambda p: (write_checkpoint(p, "qwen3", overrides=QWEN3_128), "fp8", (128, 128)),
    "deepseek_v3_fp8_128": lambda p: (write_deepseek(p, "deepseek_v3"), "fp8", (128, 128)),
    # blocks of 8: q_a_proj's 24 rows end on a block, so MLA's q_kv_a_proj stacks (128: two linears)
    "deepseek_v3_fp8_8": lambda p: (write_deepseek(p, "deepseek_v3"), "fp8", (8, 8)),
    "deepseek_v32_fp8_128": lambda p: (write_deepseek_v32(p), "fp8", (128, 128)),  # indexer projections too
    "gpt_oss_mxfp4": lambda p: (write_checkpoint(p, "gpt_oss"), "mxfp4", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_dequantized_oracle(tmp_path, case):
    src = tmp_path / "float"
    _, fmt, block = CASES[case](src)
    deq = quantize_checkpoint(src, tmp_path / "quant", fmt, **({"block": block} if block else {}))
    prompt = prompts(1, min_len=9, max_len=9)[0]
    logits, tokens, model = _run(tmp_path / "quant", prompt)
    ref_logits, ref_tokens, ref_model = _run(deq, prompt)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for hf_dir in (deq, tmp_path / "quant"):  # HF on the float twin, and HF's own FP8 / MXFP4 loader
        hf_logits, hf_tokens = _hf_logits(hf_dir, prompt, tokens)
        assert tokens == hf_tokens, hf_dir
        torch.testing.assert_close(logits, hf_logits, atol=2e-4, rtol=2e-4)
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if fmt == "fp8":  # every decoder projection stays FP8 in memory, except MLA's kv_b_proj
        assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn and m.block == block for m in fp8)
        assert not isinstance(model.lm_head, Fp8Linear)
        if "deepseek" in case:
            layer = model.model.layers[1]
            assert isinstance(layer.mlp.experts[0].down_proj, Fp8Linear)
            assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32
            stacked = block[0] == 8  # q_a_proj's rows end on a block: one FP8 matrix, else two
            attn = layer.self_attn
            linears = [attn.q_kv_a_proj] if stacked else [attn.q_a_proj, attn.kv_a_proj_with_mqa]
            assert (attn.q_kv_a_proj is not None) == stacked and all(isinstance(m, Fp8Linear) for m in linears)
            if "v32" in case:  # the indexer's query and key projections are FP8, its head weights not
                indexer = layer.self_attn.indexer
                assert isinstance(indexer.wq_b, Fp8Linear) and isinstance(indexer.wk, Fp8Linear)
                assert not isinstance(indexer.weights_proj, Fp8Linear)
            # On CUDA finish_loading packs the experts for the fused kernels: FP8 experts must arrive
            # there dequantized (scales applied), equal to the float twin's experts.
            twin = ref_model.model.layers[1].mlp.experts
            want = torch.stack([e.gate_up_proj.weight for e in twin])  # the float twin's MLPs stay fused
            layer.mlp.pack_experts()
            assert layer.mlp.fused.w13.dtype == torch.float32
            torch.testing.assert_close(layer.mlp.fused.w13, want, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(layer.mlp.fused.w2, torch.stack([e.down_proj.weight for e in twin]),
                                       atol=1e-6, rtol=1e-6)
    else:
        bank = model.model.layers[0].mlp.experts
        assert not fp8 and bank.weight_format.checkpoint is WeightFormat.MXFP4
        assert bank.weight_format.memory == "float32"


def test_online_fp8_matches_its_per_channel_round_trip(tmp_path):
    write_checkpoint(tmp_path / "float", "llama")
    twin = online_fp8_twin(tmp_path / "float", tmp_path / "twin")
    prompt = prompts(1, min_len=9, max_len=9)[0]
    logits, tokens, model = _run(tmp_path / "float", prompt, quantization="fp8")
    ref_logits, ref_tokens, _ = _run(twin, prompt)
    names = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert names == {f"model.layers.{i}.{p}" for i in range(2)
                     for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert all(m.weight_format is WeightFormat.FP8_CHANNEL for m in model.modules() if isinstance(m, Fp8Linear))
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_online_fp8_refuses_unknown_value_and_mxfp4(tmp_path):
    with pytest.raises(ConfigError, match="quantization.*one of"):
        ModelConfig(quantization="int4")
    src = tmp_path / "float"
    write_checkpoint(src, "gpt_oss")
    quantize_checkpoint(src, tmp_path / "quant", "mxfp4")
    with pytest.raises(ConfigError, match="quantization.*'none' for this mxfp4 checkpoint"):
        _run(tmp_path / "quant", [1, 2, 3], quantization="fp8")


def test_cli_quantization_flag(tmp_path, capsys):
    from meshserve.cli import main

    write_checkpoint(tmp_path, "llama")
    assert main(["generate", "Hello", "--model", str(tmp_path), "--quantization", "int4", "--device", "cpu"]) == 2
    assert "quantization='int4' is not allowed: one of ['none', 'fp8']" in capsys.readouterr().err
    assert main(["generate", "Hello", "--model", str(tmp_path), "--quantization", "fp8", "--device", "cpu",
                 "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "[finished: length]" in capsys.readouterr().err


def test_small_m_gemm_switch_swaps_the_decoder_projections(tmp_path):
    """"on": the bf16/fp16 decoder projections become StreamedLinear (the LM head does not), load
    the same weights and compute the same logits (on CPU they run F.linear; the kernel's own
    numerics are tests/unit/workers/test_quant_small_m.py, test_quant_gemv.py and tests/gpu). FP8
    layers, per-channel (online FP8) and block-scaled, take it with "auto" and "on".
    The plain float32 model's linears are input-major on CPU (workers/cpu_weights.py: MKL under
    8 rows, oneDNN from 8), which sum in another order than F.linear: logits equal to float32
    rounding (differences seen: 4e-6), the same tokens."""
    write_checkpoint(tmp_path / "float", "llama")
    prompt = prompts(1, min_len=9, max_len=9)[0]
    logits, tokens, model = _run(tmp_path / "float", prompt, small_m_gemm="on")
    ref_logits, ref_tokens, plain = _run(tmp_path / "float", prompt)
    streamed = {n for n, m in model.named_modules() if isinstance(m, StreamedLinear)}
    assert streamed == {f"model.layers.{i}.{p}" for i in range(2)
                        for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert not any(isinstance(m, StreamedLinear) for m in plain.modules())  # auto: bf16 stays on cuBLAS
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for setting, want in (("off", False), ("auto", True), ("on", True)):  # online FP8: per-channel scales
        _, _, fp8_model = _run(tmp_path / "float", prompt, quantization="fp8", small_m_gemm=setting)
        layers = [m for m in fp8_model.modules() if isinstance(m, Fp8Linear)]
        assert layers and all(m.block is None and m.small_m is want for m in layers), setting
    _, fmt, block = CASES["llama_fp8_32"](tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "block", fmt, block=block)
    for setting, want in (("off", False), ("auto", True), ("on", True)):  # block-scaled: as per-channel
        _, _, block_model = _run(tmp_path / "block", prompt, small_m_gemm=setting)
        layers = [m for m in block_model.modules() if isinstance(m, Fp8Linear)]
        assert layers and all(m.block == block and m.small_m is want for m in layers), setting
    with pytest.raises(ConfigError, match="small_m_gemm.*one of"):
        ModelConfig(small_m_gemm="maybe")


def test_small_m_gemm_on_swaps_deepseeks_mla_projections_and_shared_experts(tmp_path):
    """"on" on DeepSeek: MLA's q_kv_a (q_a and kv_a stacked)/q_b/o projections, the dense layer's
    MLP and the shared experts become StreamedLinear (same parameters: the same logits on CPU,
    where they run F.linear); kv_b_proj (folded into matrices by the attention), the routed experts (banks of
    the fused MoE), the router and the LM head do not."""
    from meshserve.workers.loader import load_model
    from tests.deepseek_models import write_deepseek

    write_deepseek(tmp_path / "ds", "deepseek_v3")
    on = load_model(tmp_path / "ds", small_m_gemm="on", progress=False)
    auto = load_model(tmp_path / "ds", progress=False)
    streamed = {n for n, m in on.named_modules() if isinstance(m, StreamedLinear)}
    attn = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_kv_a_proj", "q_b_proj", "o_proj")}
    mlp = {f"model.layers.0.mlp.{p}" for p in ("gate_up_proj", "down_proj")}  # gate and up stacked
    shared = {f"model.layers.1.mlp.shared_experts.{p}" for p in ("gate_up_proj", "down_proj")}
    assert streamed == attn | mlp | shared, sorted(streamed ^ (attn | mlp | shared))
    assert not any(isinstance(m, StreamedLinear) for m in auto.modules())
    tokens = torch.tensor([[3, 5, 7, 11]])
    h_on, h_auto = on.model.embed_tokens(tokens), auto.model.embed_tokens(tokens)
    layer_on, layer_auto = on.model.layers[1], auto.model.layers[1]
    torch.testing.assert_close(layer_on.mlp.shared_experts(h_on), layer_auto.mlp.shared_experts(h_auto))
