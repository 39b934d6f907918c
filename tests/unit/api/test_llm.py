"""The public API on a tiny checkpoint: text in and out, stop strings, streaming, abort, refusals,
logprobs, the `generate` command, and the bundled demo model against HF transformers."""

import argparse
import asyncio

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.api.llm import add_generate_parser, generate_main
from meshserve.core.outputs import FinishReason
from meshserve.errors import ConfigError
from tests.tiny_models import EOS, hf_greedy, prompts, write_checkpoint
from tests.unit.cluster.cases import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "llama"
    write_checkpoint(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, attention_backend="TORCH", max_model_len=128, num_kv_blocks=40, progress=False)


def test_text_prompt_round_trip(llm):
    out = llm.generate("Hello world, the quick brown fox", GREEDY)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello world, the quick brown fox").ids
    assert len(out.token_ids) == 20 and out.finish_reason is FinishReason.LENGTH
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_stop_strings_end_the_text(llm):
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(full.text) > 12
    stop = full.text[8:11]
    cut = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                          stop=[stop]))[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason is FinishReason.STOP and cut.stop_reason == stop
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 30


def test_eos_and_stop_token_ids(llm):
    full = llm.generate([5, 6, 7], GREEDY)[0]
    stop_tok = full.token_ids[4]
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0]
    first = full.token_ids.index(stop_tok)
    assert out.token_ids == full.token_ids[: first + 1] and out.stop_reason == stop_tok
    assert out.text == llm.tokenizer.decode(full.token_ids[:first])  # the stop token's text is left out
    if EOS in full.token_ids:  # without ignore_eos the output ends at (and includes) EOS
        eos_out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=20))[0]
        assert eos_out.token_ids == full.token_ids[: full.token_ids.index(EOS) + 1]


def test_stream_matches_generate(llm):
    want = llm.generate(["abc", "the lazy dog"], GREEDY)

    async def collect(prompt):
        deltas = [d async for d in llm.stream(prompt, GREEDY)]
        return deltas

    async def both():
        return await asyncio.gather(collect("abc"), collect("the lazy dog"))

    for deltas, ref in zip(asyncio.run(both()), want):
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert "".join(d.text for d in deltas) == ref.text
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert len(deltas) > 1


def test_leaving_a_stream_aborts_its_request(ckpt):
    llm = LLM(ckpt, attention_backend="TORCH", max_model_len=128, num_kv_blocks=40, progress=False)

    async def run():
        got = []
        async for delta in llm.stream([4, 5, 6], SamplingParams(temperature=0, max_tokens=100)):
            got.append(delta)
            if len(got) == 2:
                break
        await wait_until(lambda: not llm.core.has_unfinished(), "the engine loop to drop the left stream's "
                         "request (it notices the abort between steps)", timeout_s=10)
        return got

    assert len(asyncio.run(run())) == 2
    assert not llm.core.has_unfinished()
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_total_blocks


def test_bad_requests_are_refused_whole(llm):
    with pytest.raises(ConfigError, match="prompt"):
        llm.generate([[1, 2, 3], [1, 10_000]], GREEDY)
    with pytest.raises(ConfigError, match="max_model_len"):
        llm.generate([list(range(1, 200))], GREEDY)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ConfigError, match="params"):
        llm.generate([[1, 2], [3]], [GREEDY])
    assert not llm.core.has_unfinished()
    assert llm.generate([[1, 2]], GREEDY)[0].finish_reason is FinishReason.LENGTH


def test_logprobs_through_the_engine(llm, ckpt):
    out = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([[9, 8, 7] + out.token_ids])).logits[0].double(), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[2 + i]
        assert lp.token_id == out.token_ids[i] == int(row.argmax())
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_generate_command_streams_text(ckpt, capsys):
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", str(ckpt), "--max-tokens", "12", "--ignore-eos",
                              "--device", "cpu", "--attention-backend", "TORCH", "Hello world"])
    assert args.func(args) == 0
    out = capsys.readouterr()
    llm = LLM(ckpt, attention_backend="TORCH", progress=False)
    want = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    assert out.out == "Hello world" + want + "\n"
    assert "length" in out.err
    assert generate_main is args.func


def test_demo_model_matches_hf():
    """The bundled (trained) demo model: a text prompt through its tokenizer, greedy, vs HF."""
    from transformers import AutoModelForCausalLM

    from meshserve.demo_model import DEMO_MODEL_DIR

    llm = LLM(attention_backend="TORCH", max_model_len=256, num_kv_blocks=40, progress=False)
    out = llm.generate("The for statement is used to", SamplingParams(temperature=0, max_tokens=24))[0]
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 24, eos=1)
    assert len(out.text) > 20


def test_demo_model_default_cpu_path_matches_hf():
    """The default CPU path (CPU_SDPA with the compiled paged decode kernel at head size 64 and the
    fused layer ops, float32): a batch of eight prompts decoded together gives HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from meshserve.attention.backends.cpu_step_ops import step_ops
    from meshserve.demo_model import DEMO_MODEL_DIR

    if step_ops() is None:
        pytest.skip("the CPU module could not be built here (see the logged warning)")
    texts = ["The for statement is used to", "An exception is raised when", "A class definition",
             "The import statement", "Assignment statements are used to", "A function definition",
             "The with statement", "Names refer to objects"]
    llm = LLM(max_model_len=256, num_kv_blocks=64, progress=False)
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=24))
    assert (llm.core.info.backend, llm.core.info.dtype) == ("CPU_SDPA", "float32")
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    for out in outs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 24, eos=1), out.text


def test_prompts_helper_is_varied():
    lengths = [len(p) for p in prompts(4, min_len=3, max_len=12)]
    assert lengths == sorted(set(lengths))


def test_demo_model_cpu_prefill_in_forward_parts_matches_hf(monkeypatch):
    """A CPU step of more than CPU_FORWARD_TOKENS new tokens runs its forward in parts of whole
    sequences (workers/runner.py): the eight prompts' prefill here in parts of at most 12 tokens,
    decoded together afterwards, gives HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from meshserve.demo_model import DEMO_MODEL_DIR
    from meshserve.workers import runner

    monkeypatch.setattr(runner, "CPU_FORWARD_TOKENS", 12)
    forwards = []
    real = runner.ModelRunner._forward
    monkeypatch.setattr(runner.ModelRunner, "_forward",
                        lambda self, q, *a: forwards.append(sum(q)) or real(self, q, *a))
    texts = ["The for statement is used to", "An exception is raised when", "A class definition",
             "The import statement", "Assignment statements are used to", "A function definition",
             "The with statement", "Names refer to objects"]
    llm = LLM(max_model_len=256, num_kv_blocks=64, progress=False)
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=16))
    total, longest = sum(len(o.prompt_token_ids) for o in outs), max(len(o.prompt_token_ids) for o in outs)
    parts = []  # the first step's forwards: the prompts
    while sum(parts) < total:
        parts.append(forwards[len(parts)])
    assert sum(parts) == total and len(parts) > 1 and max(parts) <= max(12, longest)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    for out in outs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 16, eos=1), out.text
