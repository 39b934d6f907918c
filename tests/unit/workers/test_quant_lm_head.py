"""The LM head in FP8 (ModelConfig.quantize_lm_head, with online FP8): off by default and then the
head exactly as before; on, a per-channel Fp8Linear (Fp8ParallelLMHead under tensor parallelism)
whose logits equal a float64 matmul of its dequantized weights, close to the float head's and
with the same greedy tokens; tied embeddings keep the embedding and get an FP8 copy; FP8
checkpoints get their float head quantized; bad combinations are refused naming the field.

Oracles: tests/quant_models.py's per-channel quantizer (written apart from meshserve's) and its
float twins, which HF-style float checkpoints hold the round-tripped weights in float64 -> float32.
"""

import pytest
import torch
from torch import nn

from meshserve.api.llm import LLM
from meshserve.config import AttentionConfig, CacheConfig, ModelConfig
from meshserve.errors import ConfigError
from meshserve.parallel.groups import ParallelContext
from meshserve.parallel.layers import ParallelLMHead, vocab_range
from meshserve.workers.checkpoint import Checkpoint, read_arch
from meshserve.workers.loader import load_model
from meshserve.workers.models import tensor_parallel_transform
from meshserve.workers.quant import layers
from meshserve.workers.quant.formats import WeightFormat
from meshserve.workers.quant.fp8 import quantize_fp8_per_channel
from meshserve.workers.quant.layers import Fp8Linear, Fp8ParallelLMHead
from meshserve.workers.step import NewRequest, ScheduledSeq, StepPlan
from meshserve.workers.worker import Worker
from tests.encdec_models import write_bart
from tests.quant_models import fp8_per_channel, online_fp8_twin, quantize_checkpoint
from tests.tiny_models import prompts, write_checkpoint

NEW_TOKENS = 6
TIED = {"tie_word_embeddings": True}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8head")
    write_checkpoint(root / "untied", "llama")
    write_checkpoint(root / "tied", "llama", overrides=TIED)
    return root


def _tensor(path, name):
    with Checkpoint(path) as ckpt:
        return ckpt.read(name, None, 0, None)


def _hidden(n=64, seed=0):
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def _run(path, prompt, **model):
    """Greedy-decode NEW_TOKENS tokens through a Worker: (each step's logits [NEW_TOKENS, V], tokens, model)."""
    w = Worker(ModelConfig(model=str(path), max_model_len=64, **model), CacheConfig(block_size=4, num_kv_blocks=64),
               AttentionConfig(backend="TORCH"), device="cpu", progress=False)
    w.start()
    model, seen = w.runner.model, []
    original = model.compute_logits
    model.compute_logits = lambda h: seen.append(original(h)) or seen[-1]
    new = [NewRequest("r", prompt, {"temperature": 0.0})]
    tokens, context, step_tokens = [], 0, prompt
    for step in range(NEW_TOKENS):
        out = w.runner.execute(StepPlan.from_seqs(step, [ScheduledSeq("r", step_tokens, context, [list(range(1, 21))])],
                                                  new))
        new, context = [], context + len(step_tokens)
        tokens.append(out.sampled[0].token_id)
        step_tokens = [tokens[-1]]
    w.shutdown()
    return torch.cat([s[-1:] for s in seen]), tokens, model


def test_fp8_head_is_its_checkpoints_per_channel_round_trip_and_computes_in_float64_agreement(ckpts):
    path = ckpts / "untied"
    model = load_model(path, quantization="fp8", quantize_lm_head=True, progress=False)
    head = model.lm_head
    assert isinstance(head, Fp8Linear) and head.block is None and head.weight_format is WeightFormat.FP8_CHANNEL
    assert head.small_m  # decode rows take the small-M GEMV on CUDA, as the projections do
    q, scale, deq = fp8_per_channel(_tensor(path, "lm_head.weight"))
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(head.weight_scale, scale, rtol=0, atol=0)
    h = _hidden()
    with torch.no_grad():
        logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (64, 320)
    torch.testing.assert_close(logits.double(), h.double() @ deq.T, rtol=1e-5, atol=1e-5)
    # Against the float head: FP8 rounding moves the logits by a few percent of their norm; random
    # hidden states make near ties (which may flip), so most but not all agree on the top token.
    plain = load_model(path, quantization="fp8", progress=False)
    with torch.no_grad():
        ref = plain.compute_logits(h)
    rel = ((logits - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
    agree = (logits.argmax(1) == ref.argmax(1)).float().mean().item()
    assert 0 < rel < 0.05 and agree >= 0.85, (rel, agree)


def test_flag_off_leaves_the_head_exactly_as_before(ckpts):
    for name in ("untied", "tied"):
        path = ckpts / name
        for quantization in ("none", "fp8"):
            model = load_model(path, quantization=quantization, progress=False)
            head = model.lm_head
            assert type(head) is nn.Linear and head.weight.dtype == torch.float32, (name, quantization)
            if name == "tied":
                assert head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
            else:
                assert torch.equal(head.weight, _tensor(path, "lm_head.weight"))
    assert ModelConfig().quantize_lm_head is False


def test_online_fp8_with_the_head_matches_its_float_twin_end_to_end(ckpts, tmp_path):
    """Greedy decoding with every projection and the head in FP8 equals the float checkpoint whose
    weights are those round trips (float32 rounding apart), and keeps the float head's tokens."""
    twin = online_fp8_twin(ckpts / "untied", tmp_path / "twin", lm_head=True)
    prompt = prompts(1, min_len=9, max_len=9)[0]
    logits, tokens, model = _run(ckpts / "untied", prompt, quantization="fp8", quantize_lm_head=True)
    ref_logits, ref_tokens, _ = _run(twin, prompt)
    assert isinstance(model.lm_head, Fp8Linear)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    float_head_logits, float_head_tokens, _ = _run(ckpts / "untied", prompt, quantization="fp8")
    assert tokens == float_head_tokens
    rel = ((logits - float_head_logits).norm(dim=1) / float_head_logits.norm(dim=1)).max().item()
    assert rel < 0.05, rel


def test_tied_embedding_stays_float_and_the_head_gets_an_fp8_copy(ckpts, tmp_path):
    path = ckpts / "tied"
    model = load_model(path, quantization="fp8", quantize_lm_head=True, progress=False)
    embed = _tensor(path, "model.embed_tokens.weight")
    assert torch.equal(model.model.embed_tokens.weight, embed)  # lookups stay exact, in the model dtype
    head = model.lm_head
    assert isinstance(head, Fp8Linear) and head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    q, scale, _ = fp8_per_channel(embed)
    assert torch.equal(head.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(head.weight_scale, scale, rtol=0, atol=0)
    twin = online_fp8_twin(path, tmp_path / "twin", lm_head=True)  # untied: embedding float, head round-tripped
    prompt = prompts(1, min_len=9, max_len=9)[0]
    logits, tokens, _ = _run(path, prompt, quantization="fp8", quantize_lm_head=True)
    ref_logits, ref_tokens, _ = _run(twin, prompt)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_fp8_checkpoint_gets_its_float_head_quantized_per_channel(ckpts, tmp_path):
    """A block-scaled FP8 release keeps its projections as published and its bf16 head becomes
    per-channel FP8; --quantization none with the flag is refused (ModelConfig)."""
    deq = quantize_checkpoint(ckpts / "untied", tmp_path / "quant", "fp8", block=(32, 32))
    twin = online_fp8_twin(deq, tmp_path / "twin", projections=False, lm_head=True)
    prompt = prompts(1, min_len=9, max_len=9)[0]
    logits, tokens, model = _run(tmp_path / "quant", prompt, quantization="fp8", quantize_lm_head=True)
    ref_logits, ref_tokens, _ = _run(twin, prompt)
    assert isinstance(model.lm_head, Fp8Linear) and model.lm_head.block is None
    assert all(m.block == (32, 32) for n, m in model.named_modules() if isinstance(m, Fp8Linear) and n != "lm_head")
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def _rank_model(path, rank, tp, **kwargs):
    arch = read_arch(path)
    ctx = ParallelContext(rank=rank, tp=tp)
    return load_model(path, rank=rank, world=tp, progress=False, quantization="fp8", quantize_lm_head=True,
                      transform=lambda m: tensor_parallel_transform(arch)(m, ctx), **kwargs)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp_ranks_hold_their_vocabulary_rows_of_the_fp8_head(tmp_path, tied):
    """A 321-token vocabulary at tp = 2 splits 161 / 160 (ParallelLMHead's ceil(V / tp)): each
    rank's FP8 rows and scales are the tp = 1 head's, and its local logits are those columns of
    the tp = 1 logits (the all-gather: tests/integration/test_tensor_parallel.py)."""
    path = tmp_path / "ckpt"
    write_checkpoint(path, "llama", overrides={"vocab_size": 321, **(TIED if tied else {})})
    full = load_model(path, quantization="fp8", quantize_lm_head=True, progress=False).lm_head
    h = _hidden(5, seed=1)
    with torch.no_grad():
        want = full(h)
    tp = 2
    for rank in range(tp):
        model = _rank_model(path, rank, tp)
        head = model.lm_head
        assert isinstance(head, Fp8ParallelLMHead) and isinstance(head, ParallelLMHead)
        start, stop = vocab_range(321, ParallelContext(rank=rank, tp=tp))
        assert head.weight.shape == (stop - start, 64) and stop - start == (161, 160)[rank]
        assert torch.equal(head.weight.view(torch.uint8), full.weight[start:stop].view(torch.uint8))
        torch.testing.assert_close(head.weight_scale, full.weight_scale[start:stop], rtol=0, atol=0)
        if tied:  # the embedding's shard stays float
            embed = _tensor(path, "model.embed_tokens.weight")[start:stop]
            assert torch.equal(model.model.embed_tokens.weight, embed)
        with torch.no_grad():
            torch.testing.assert_close(head.local_logits(h), want[:, start:stop], rtol=0, atol=0)


def test_vocabulary_split_head_takes_per_channel_scales_only():
    ctx = ParallelContext(rank=0, tp=2)
    model = nn.Module()
    with torch.device("meta"):
        model.lm_head = ParallelLMHead(320, 64, ctx=ctx)
    with pytest.raises(ValueError, match="per-channel scales only"):
        layers.convert_linears(model, {"lm_head"}, (32, 32))
    assert type(model.lm_head) is ParallelLMHead  # nothing swapped


def test_per_channel_gemm_serves_a_vocabulary_that_is_not_a_multiple_of_16(monkeypatch):
    """cuBLASLt's FP8 GEMMs take N only in multiples of 16 (a stand-in for CPU torch's _scaled_mm
    asserts it): 330 rows run 320 through the row-wise GEMM and 10 through the reference; a head
    of fewer than 16 rows is all reference."""
    monkeypatch.setattr(layers, "_fast_path", lambda x: True)
    real = torch._scaled_mm
    widths = []

    def cuda_rules(a, b, **kwargs):
        assert b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, f"mat2 {tuple(b.shape)} not divisible by 16"
        widths.append(b.shape[1])
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", cuda_rules)
    g = torch.Generator().manual_seed(3)
    for n, want_widths in ((330, [320]), (10, [])):
        widths.clear()
        wq, scale = quantize_fp8_per_channel(torch.randn(n, 64, generator=g) * 0.05)
        bias = torch.randn(n, generator=g).bfloat16()
        x = torch.randn(2, 17, 64, generator=g).bfloat16()  # 34 rows: past the small-M rows
        y = layers.fp8_linear(x, wq, scale, None, small_m=True, bias=bias)
        assert y.shape == (2, 17, n) and y.dtype == torch.bfloat16 and widths == want_widths
        w64 = wq.double() * scale.double()[:, None]
        ref = x.double() @ w64.T + bias.double()
        tail = slice(n - n % 16, n)  # unquantized activations there: bf16 output rounding only
        torch.testing.assert_close(y[..., tail].double(), ref[..., tail], rtol=2**-7, atol=1e-2)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 0.05  # e4m3 activations in the GEMM part


def test_per_channel_quantization_in_row_chunks_is_the_one_pass_result(monkeypatch):
    """quantize_fp8_per_channel works through a big head a chunk of rows at a time (bounded float32
    temporaries on the device while loading): the same bits as the oracle's single pass."""
    from meshserve.workers.quant import fp8

    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(4)) * 0.1
    w[3] = 0.0  # an all-zero row keeps a finite scale
    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 64 * 7)  # 7 rows a chunk: 8 chunks, the last one row
    q, scale = fp8.quantize_fp8_per_channel(w)
    want_q, want_scale, _ = fp8_per_channel(w)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)


def test_bad_combinations_are_refused_naming_the_field(ckpts, tmp_path):
    with pytest.raises(ConfigError, match=r"quantize_lm_head.*quantization='fp8'"):
        ModelConfig(quantize_lm_head=True)
    with pytest.raises(ConfigError, match="quantize_lm_head.*true or false"):
        ModelConfig(quantization="fp8", quantize_lm_head="yes")
    with pytest.raises(ConfigError, match=r"quantize_lm_head.*quantization='fp8'"):
        load_model(ckpts / "untied", quantization="none", quantize_lm_head=True, progress=False)
    write_checkpoint(tmp_path / "gptoss", "gpt_oss")
    quantize_checkpoint(tmp_path / "gptoss", tmp_path / "mxfp4", "mxfp4")
    with pytest.raises(ConfigError, match="quantization.*'none' for this mxfp4 checkpoint"):
        load_model(tmp_path / "mxfp4", quantization="fp8", quantize_lm_head=True, progress=False)
    write_bart(tmp_path / "bart")  # an encoder-decoder loads in the model dtype: FP8 is refused, not ignored
    for head in (True, False):
        worker = Worker(ModelConfig(model=str(tmp_path / "bart"), quantization="fp8", quantize_lm_head=head),
                        CacheConfig(block_size=4, num_kv_blocks=16), AttentionConfig(backend="TORCH"), device="cpu",
                        progress=False)
        with pytest.raises(ConfigError, match="quantization.*'none' for an encoder-decoder"):
            worker.start()
    import transformers

    bert = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=40)
    transformers.BertModel(bert).save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match="quantize_lm_head.*no LM head"):
        LLM(str(tmp_path / "bert"), quantization="fp8", quantize_lm_head=True, device="cpu", progress=False)


def test_a_gpu_serving_block_fp8_but_not_per_channel_refuses_the_head(monkeypatch):
    """Compute capability 8.9 serves block-scaled FP8 checkpoints but not per-channel FP8 (row-wise
    _scaled_mm needs sm90, quant/support.py): the head's format is checked too, before any read."""
    from meshserve.workers.loader import _check_served
    from meshserve.workers.quant.formats import QuantMethod, WeightQuant

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    block = WeightQuant(QuantMethod.FP8, block=(128, 128))
    _check_served(block, torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"quantize_lm_head.*compute capability >= 9\.0"):
        _check_served(block, torch.device("cuda"), lm_head=True)


def test_cli_flag(ckpts, capsys):
    from meshserve.api.serve import configs_of
    from meshserve.cli import build_parser, main

    path = str(ckpts / "untied")
    engine, _, _ = configs_of(build_parser().parse_args(["serve", path, "--quantization", "fp8",
                                                         "--quantize-lm-head"]))
    assert engine.model.quantize_lm_head and engine.model.quantization == "fp8"
    assert not configs_of(build_parser().parse_args(["serve", path]))[0].model.quantize_lm_head
    assert main(["generate", "Hello", "--model", path, "--quantize-lm-head", "--device", "cpu"]) == 2
    assert "quantize_lm_head=True is not allowed: false with quantization='none'" in capsys.readouterr().err
    assert main(["generate", "Hello", "--model", path, "--quantization", "fp8", "--quantize-lm-head", "--device",
                 "cpu", "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "[finished: length]" in capsys.readouterr().err
