"""Beam search and n / best_of sampling through `meshserve.LLM`, against independent oracles.

Beam search equals HF transformers' own `generate(num_beams=..., do_sample=False, length_penalty=...,
early_stopping=..., num_return_sequences=num_beams)`: the same sequences in the same order and
the same `sequences_scores`, on a tiny random Llama whose EOS is a token its beams often
propose (so beams end early and the stopping rules matter). The KV pool's invariants hold after
every step and its free count returns to where it started; a pool too small for every beam
forces preemption and changes nothing.

n / best_of: sample i of a request seeded s is exactly the request run alone with seed s + i
(its blocks are forked off the prompt's, copy-on-write: a wrong fork changes its logits, hence
its tokens), greedy samples all equal the greedy output, and best_of keeps the n best by the
samples' own cumulative logprobs.
"""

from collections import Counter

import pytest
import torch

from meshserve import LLM, BeamSearchParams, SamplingParams
from meshserve.errors import ConfigError
from tests.tiny_models import hf_greedy, prompts, write_checkpoint

NEW = 12
MAX_LEN = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint dir, HF model, eos id, prompts): EOS is the token greedy decoding emits most."""
    root = tmp_path_factory.mktemp("beam")
    batch = prompts(3, seed=3, min_len=5, max_len=20)
    hf = write_checkpoint(root / "probe", "llama")
    common = Counter(t for p in batch for t in hf_greedy(hf, p, NEW, eos=-1)).most_common(1)[0][0]
    hf = write_checkpoint(root / "llama", "llama", overrides={"eos_token_id": common})  # same weights
    return root / "llama", hf, common, batch


@pytest.fixture(scope="module")
def llm(model):
    out = LLM(model[0], attention_backend="TORCH", block_size=16, num_kv_blocks=64, max_model_len=MAX_LEN,
              progress=False)
    yield out
    out.shutdown()


def _hf_beams(hf, prompt, eos, params: BeamSearchParams):
    with torch.no_grad():
        r = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                        max_new_tokens=params.max_tokens, num_beams=params.beam_width, do_sample=False,
                        length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                        num_return_sequences=params.beam_width, eos_token_id=eos, pad_token_id=eos,
                        return_dict_in_generate=True, output_scores=True)
    seqs = []
    for s in r.sequences[:, len(prompt):].tolist():  # HF pads after an EOS with the pad id (= EOS)
        seqs.append(s[: s.index(eos) + 1] if eos in s else s)
    return seqs, r.sequences_scores.tolist()


def _checked_every_step(llm):
    """Run the KV manager's invariant check after every scheduler update."""
    sched = llm.core.scheduler
    update = sched.update

    def checked(step, output):
        touched = update(step, output)
        llm.core.kv.check_invariants()
        return touched

    sched.update = checked
    return update


CASES = [
    BeamSearchParams(beam_width=2, max_tokens=NEW),
    BeamSearchParams(beam_width=3, max_tokens=NEW, length_penalty=0.0, early_stopping=True),
    BeamSearchParams(beam_width=4, max_tokens=NEW, length_penalty=0.5, early_stopping="never"),
    BeamSearchParams(beam_width=4, max_tokens=NEW, length_penalty=2.0),
    BeamSearchParams(beam_width=5, max_tokens=NEW, length_penalty=-1.0, early_stopping=True),
    BeamSearchParams(beam_width=3, max_tokens=NEW, length_penalty=1.5, early_stopping="never"),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"w{p.beam_width}-lp{p.length_penalty}-es{p.early_stopping}")
def test_beam_search_equals_hf(llm, model, params):
    _, hf, eos, batch = model
    kv = llm.core.kv
    free = kv.num_free_blocks
    copies = kv.stats.cow_copies
    original = _checked_every_step(llm)
    try:
        outs = llm.beam_search(batch, params)
    finally:
        llm.core.scheduler.update = original
    assert kv.num_free_blocks == free and kv.num_requests == 0 and not llm.core.scheduler.requests
    assert kv.stats.cow_copies > copies  # beams forked inside a partial block
    ended_by_eos = 0
    for prompt, out in zip(batch, outs):
        want, scores = _hf_beams(hf, prompt, eos, params)
        got = [s.token_ids for s in out.sequences]
        assert got == want, f"prompt {prompt}: meshserve {got} != HF {want}"
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        for s in out.sequences:
            length = len(s.token_ids) ** params.length_penalty
            assert s.score == pytest.approx(s.cum_logprob / length, abs=1e-9)
            assert (s.finish_reason == "stop") == (s.token_ids[-1] == eos)
            ended_by_eos += s.token_ids[-1] == eos
        assert out.prompt_token_ids == prompt
    assert ended_by_eos or params.length_penalty > 1  # the EOS rules were exercised (long ones win above 1)


def test_beam_search_under_preemption(model):
    """A pool far smaller than the beams need: beams (held ones too) are preempted and recomputed,
    results unchanged."""
    path, hf, eos, batch = model
    params = BeamSearchParams(beam_width=4, max_tokens=NEW, length_penalty=0.5)
    small = LLM(path, attention_backend="TORCH", block_size=16, num_kv_blocks=6, max_model_len=MAX_LEN,
                async_scheduling=False, progress=False)  # the synchronous engine here, overlap elsewhere
    try:
        free = small.core.kv.num_free_blocks
        outs = small.beam_search(batch, params)
        assert small.core.scheduler.stats.num_preemptions > 0
        assert small.core.kv.num_free_blocks == free
        small.core.kv.check_invariants()
    finally:
        small.shutdown()
    for prompt, out in zip(batch, outs):
        assert [s.token_ids for s in out.sequences] == _hf_beams(hf, prompt, eos, params)[0]


def test_beam_search_with_triton_paged_attention(model):
    """The paged TRITON kernels (Triton interpreter on CPU) read the forked, copied blocks right."""
    path, hf, eos, batch = model
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    triton = LLM(path, attention_backend="TRITON", block_size=16, num_kv_blocks=32, max_model_len=MAX_LEN,
                 progress=False)
    try:
        assert triton.core.info.backend == "TRITON"
        outs = triton.beam_search(batch[1:], params)
        assert triton.core.kv.stats.cow_copies > 0 and triton.core.kv.num_requests == 0
    finally:
        triton.shutdown()
    for prompt, out in zip(batch[1:], outs):
        assert [s.token_ids for s in out.sequences] == _hf_beams(hf, prompt, eos, params)[0]


def test_beam_search_text_and_ignore_eos(llm, model):
    _, _, eos, batch = model
    out = llm.beam_search("Hello world", BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt == "Hello world" and len(out.sequences) == 2
    assert out.sequences[0].score >= out.sequences[1].score
    for s in out.sequences:
        assert len(s.token_ids) == 5 and s.finish_reason == "length"
        assert s.text == llm.tokenizer.decode(s.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0), "beam_width"), (dict(beam_width=11), "beam_width"), (dict(beam_width=2.0), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"), (dict(beam_width=2, length_penalty=float("nan")),
                                                        "length_penalty"),
    (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
])
def test_bad_beam_params(kwargs, field):
    with pytest.raises(ConfigError) as e:
        BeamSearchParams(**kwargs)
    assert e.value.field == field


def test_beam_search_refusals_leave_nothing(llm, model):
    batch = model[3]
    kv = llm.core.kv
    free = kv.num_free_blocks
    with pytest.raises(ConfigError, match="max_tokens"):  # one prompt too long for its beams: none runs
        llm.beam_search([batch[0], list(range(1, 60))], BeamSearchParams(beam_width=2, max_tokens=10))
    with pytest.raises(ConfigError, match="prompt"):
        llm.beam_search([batch[0], [10**6]], BeamSearchParams(beam_width=2))
    with pytest.raises(ConfigError, match="params"):
        llm.beam_search(batch, SamplingParams())
    assert kv.num_free_blocks == free and not llm.core.scheduler.requests and not llm.core.has_unfinished()


# -- n / best_of --------------------------------------------------------------------------------


def test_n_greedy_equals_one_greedy(llm, model):
    _, hf, eos, batch = model
    kv = llm.core.kv
    free = kv.num_free_blocks
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW, n=3))
    for prompt, out in zip(batch, outs):
        want = hf_greedy(hf, prompt, NEW, eos=eos)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in out.outputs), (out.outputs, want)
        assert out.token_ids == want
    assert kv.num_free_blocks == free and kv.num_requests == 0


def test_n_seeded_samples_equal_independent_requests(llm, model):
    batch = model[3]
    kv = llm.core.kv
    free, copies = kv.num_free_blocks, kv.stats.cow_copies
    params = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=NEW, n=3, logprobs=2)
    outs = llm.generate(batch, params)
    assert kv.stats.cow_copies > copies and kv.num_free_blocks == free
    for prompt, out in zip(batch, outs):
        for i, choice in enumerate(out.outputs):
            alone = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=50, seed=11 + i, max_tokens=NEW,
                                                        logprobs=2))[0]
            assert choice.token_ids == alone.token_ids
            assert [lp.logprob for lp in choice.logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs],
                                                                           abs=1e-5)
            assert choice.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in alone.logprobs), abs=1e-4)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent draws
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(batch, params)] == \
        [[c.token_ids for c in o.outputs] for o in outs]  # reproducible


def test_best_of_returns_the_n_best(llm, model):
    batch = model[3]
    base = dict(temperature=1.0, max_tokens=NEW)
    out = llm.generate(batch[1], SamplingParams(**base, seed=5, n=2, best_of=5))[0]
    alone = [llm.generate(batch[1], SamplingParams(**base, seed=5 + i, logprobs=0))[0] for i in range(5)]
    cum = sorted(((sum(lp.logprob for lp in a.logprobs), a.token_ids) for a in alone), key=lambda c: -c[0])[:2]
    assert [c.token_ids for c in out.outputs] == [t for _, t in cum]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([c for c, _ in cum], abs=1e-4)
    assert all(c.logprobs is None for c in out.outputs)  # computed for ranking, not asked for
    assert llm.core.kv.num_requests == 0


def test_n_with_one_token_prompt_and_stream_order(llm):
    out = llm.generate([[7]], SamplingParams(temperature=0.8, seed=1, max_tokens=4, n=2))[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) <= 4 for c in out.outputs)
    core = llm.core
    core.add(core.make_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, n=2), request_id="s"))
    deltas = []
    while core.has_unfinished():
        deltas += core.step()
    assert {d.request_id for d in deltas} == {"s"} and {d.index for d in deltas} == {0, 1}
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    assert sum(d.finish_reason is not None for d in deltas) == 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=2, best_of=1), "best_of"), (dict(n=1.5), "n"), (dict(best_of=0), "best_of"),
    (dict(n=300), "n"),
])
def test_bad_n_best_of(kwargs, field):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_n_and_beam_width_above_max_num_seqs_are_refused(model):
    small = LLM(model[0], attention_backend="TORCH", block_size=16, num_kv_blocks=16, max_model_len=MAX_LEN,
                max_num_seqs=4, progress=False)
    try:
        with pytest.raises(ConfigError, match="best_of.*max_num_seqs=4"):
            small.generate([[1, 2, 3]], SamplingParams(n=2, best_of=5))
        with pytest.raises(ConfigError, match="beam_width=5.*max_num_seqs=4"):
            small.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=5))
        assert not small.core.scheduler.requests
    finally:
        small.shutdown()


def test_abort_group_frees_everything(llm):
    core = llm.core
    free = core.kv.num_free_blocks
    core.add(core.make_request(list(range(1, 30)), SamplingParams(max_tokens=20, n=3), request_id="g"))
    for _ in range(3):
        core.step()
    core.drain()
    delta = core.abort("g")
    assert delta.finished and delta.finish_reason == "abort"
    while core.has_unfinished():
        core.step()
    assert core.kv.num_free_blocks == free and not core.scheduler.requests
