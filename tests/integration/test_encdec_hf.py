"""BART (encoder-decoder) end to end against HF transformers' own BartForConditionalGeneration.

A tiny random-weight checkpoint written by `save_pretrained` (eager attention, float32): greedy
tokens equal HF's `generate` for TORCH and TRITON (interpreter), through preemption and chunked
recompute; every encoder and decoder layer's hidden states equal HF's `output_hidden_states`;
aborts and finishes leave no block held; bad prompts are refused naming the field;
`meshserve generate --model DIR` and `LLM.stream` serve it.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from meshserve import LLM, BeamSearchParams, SamplingParams
from meshserve.errors import ConfigError
from tests.encdec_models import MAX_POS, START, bart_case, hf_greedy_encdec
from tests.tiny_models import EOS, VOCAB, tiny_tokenizer

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """(checkpoint dir, HF model, prompts, HF's greedy tokens per prompt)."""
    path = tmp_path_factory.mktemp("bart")
    return path, *bart_case(path, max_new_tokens=NEW_TOKENS)


def _used_blocks_match_holdings(core) -> None:
    """Every block in use is held by exactly one table entry or encoder block of a running request."""
    held = [b for r in core.scheduler.running for b in r.encoder_blocks]
    held += [b for rid in core.kv.request_ids() for t in core.kv.block_tables(rid) for b in t]
    assert len(held) == len(set(held)) == core.kv.pool.num_used_blocks, (len(held), core.kv.pool.num_used_blocks)


# The phase splits (attention/backends/phase_split.py): decoder self- and cross-attention prefill
# on one backend and decode on the other (cross layers' encoder tables cut with the step).
SPLITS = {"prefill=TRITON,decode=TORCH": "TRITON prefill + TORCH decode",
          "prefill=CPU_SDPA,decode=TRITON": "CPU_SDPA prefill + TRITON decode"}


@pytest.mark.parametrize("backend", ["TORCH", "CPU_SDPA", "TRITON", *SPLITS])
def test_greedy_tokens_equal_hf(bart, backend):
    path, _, prompts, want = bart
    n = 2 if "TRITON" in backend else 4  # TRITON runs in the interpreter
    llm = LLM(path, attention_backend=backend, num_kv_blocks=64, block_size=16, progress=False)
    assert llm.core.info.backend == SPLITS.get(backend, backend) and llm.core.info.is_encoder_decoder
    outs = llm.generate(prompts[-n:], GREEDY)
    assert [o.token_ids for o in outs] == want[-n:]
    assert [o.encoder_prompt_token_ids for o in outs] == prompts[-n:]
    assert all(o.prompt_token_ids == [START] for o in outs)
    assert llm.core.kv.pool.num_used_blocks == 0


def test_preemption_and_chunked_recompute_equal_hf(bart):
    """22 blocks of 4 tokens cannot hold a 23- and a 40-token encoder input with 13 decoder tokens
    each: the newer request (the 40-token one) is preempted. Its recompute re-runs the encoder, and
    a 42-token step budget leaves room for 2 decoder tokens beside it: the rest come in chunks."""
    path, _, prompts, want = bart
    llm = LLM(path, num_kv_blocks=22, block_size=4, max_num_batched_tokens=42, max_model_len=20, progress=False)
    core = llm.core
    reqs = [core.add_request(p, GREEDY) for p in prompts[2:]]
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while core.has_unfinished():
        for d in core.step():
            outs[d.request_id] += d.token_ids
        _used_blocks_match_holdings(core)
    assert reqs[1].num_preemptions >= 1
    assert [outs[r.request_id] for r in reqs] == want[2:]
    assert core.kv.pool.num_used_blocks == 0


def test_hidden_states_per_layer_equal_hf(bart):
    """Encoder layers over the prompt, decoder layers over HF's own tokens fed back one per step."""
    path, hf, prompts, want = bart
    prompt, tokens = prompts[2], want[2]
    llm = LLM(path, num_kv_blocks=64, progress=False)
    model = llm.core.executor.worker.runner.model
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        return lambda _m, _i, out: seen.setdefault(name, []).append(out.detach().clone())

    hooks = [layer.register_forward_hook(keep(f"enc{i}")) for i, layer in enumerate(model.model.encoder.layers)]
    hooks += [layer.register_forward_hook(keep(f"dec{i}")) for i, layer in enumerate(model.model.decoder.layers)]
    try:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(tokens), ignore_eos=True))
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([[START, *tokens[:-1]]]),
                 output_hidden_states=True)
    for i in range(len(model.model.encoder.layers)):
        (got,) = seen[f"enc{i}"]  # the encoder ran once
        torch.testing.assert_close(got, ref.encoder_hidden_states[i + 1][0], atol=2e-5, rtol=1e-4)
    for i in range(len(model.model.decoder.layers)):
        got = torch.cat(seen[f"dec{i}"])  # one row per step
        torch.testing.assert_close(got, ref.decoder_hidden_states[i + 1][0], atol=2e-5, rtol=1e-4)


def test_aborts_leave_no_block_held(bart):
    path, _, prompts, _ = bart
    llm = LLM(path, num_kv_blocks=30, block_size=4, max_model_len=24, progress=False)
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in prompts * 2]
    for _ in range(3):
        core.step()
        _used_blocks_match_holdings(core)
    assert any(r.encoder_blocks for r in reqs) and core.scheduler.waiting  # some hold blocks, some wait
    for r in reqs[::2]:  # running and waiting ones
        core.abort(r.request_id)
        _used_blocks_match_holdings(core)
    while core.has_unfinished():
        core.step()
        _used_blocks_match_holdings(core)
    assert core.kv.pool.num_used_blocks == 0 and core.kv.num_requests == 0
    assert all(not r.encoder_blocks for r in reqs)


def test_bad_prompts_are_refused_naming_the_field(bart):
    path, _, prompts, _ = bart
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=32, progress=False)
    with pytest.raises(ConfigError, match=r"prompt.*65 tokens.*1\.\.31 tokens.*max_position_embeddings=64"):
        llm.core.make_request([5] * (MAX_POS + 1))
    with pytest.raises(ConfigError, match=r"prompt.*40 tokens.*1\.\.31.*max_num_batched_tokens=32"):
        llm.generate([prompts[0], prompts[3]], GREEDY)  # one bad prompt refuses the whole call
    with pytest.raises(ConfigError, match="prompt"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ConfigError, match=f"token ids in \\[0, {VOCAB}\\)"):
        llm.generate([[3, VOCAB]], GREEDY)
    with pytest.raises(ConfigError, match=r"n.*1 for encoder-decoder"):
        llm.generate(prompts[1], SamplingParams(n=2, temperature=0, max_tokens=4))
    with pytest.raises(ConfigError, match=r"beam.*not built for encoder-decoder"):
        llm.beam_search([prompts[1]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not llm.core.has_unfinished() and llm.core.kv.pool.num_used_blocks == 0
    assert llm.generate(prompts[1], GREEDY)[0].finish_reason is not None  # still serves


def test_forced_bos_token_starts_the_decoder_as_hf_forces_it(bart, tmp_path):
    """generation_config.json's forced_bos_token_id: HF forces it as the first generated token;
    here it follows the start token in the decoder's prompt, so the outputs after it agree."""
    import shutil

    path, hf, prompts, _ = bart
    forced = 7
    shutil.copytree(path, tmp_path / "bos")
    (tmp_path / "bos" / "generation_config.json").write_text(json.dumps({"forced_bos_token_id": forced}))
    llm = LLM(tmp_path / "bos", num_kv_blocks=64, progress=False)
    assert llm.core.info.decoder_prompt == (START, forced)
    got = [o.token_ids for o in llm.generate(prompts[1:3], GREEDY)]
    for prompt, tokens in zip(prompts[1:3], got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS + 1, do_sample=False,
                              eos_token_id=EOS, pad_token_id=1, forced_bos_token_id=forced)
        assert out[0, :2].tolist() == [START, forced]
        assert tokens == out[0, 2:].tolist()


def test_generate_command_prints_hf_text(bart, capsys):
    from meshserve.cli import main

    path, hf, _, _ = bart
    text = "Once upon a time there was a tiny model"
    tok = tiny_tokenizer()
    ref = hf_greedy_encdec(hf, tok.encode(text).ids, 8)
    assert main(["generate", "--model", str(path), "--max-tokens", "8", "--device", "cpu", text]) == 0
    assert capsys.readouterr().out.strip() == tok.decode([t for t in ref if t != EOS]).strip()


def test_stream_serves_the_same_tokens(bart):
    """LLM.stream goes through the Coordinator (its own admission checks) to the same engine."""
    path, _, prompts, want = bart
    llm = LLM(path, num_kv_blocks=64, progress=False)

    async def run(params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for delta in llm.stream(prompts[1], params):
            tokens += delta.token_ids
        return tokens

    try:
        assert asyncio.run(run(GREEDY)) == want[1]
        # A server refuses a max_tokens the decoder cannot hold: max_model_len minus the start token.
        with pytest.raises(ConfigError, match=rf"max_tokens.*\[1, {MAX_POS - 1}\].*decoder start"):
            asyncio.run(run(SamplingParams(max_tokens=MAX_POS)))
    finally:
        llm.shutdown()
