"""Sampler and SamplingParams against independent per-token oracles (plain Python loops, float64)."""

import math

import pytest
import torch

from meshserve.core.outputs import TokenLogprobs
from meshserve.core.sampling_params import SamplingParams
from meshserve.errors import ConfigError
from meshserve.workers.sampler import Sampler, SamplingRow, filter_logits
from meshserve.workers.step import NewRequest, SampledToken, ScheduledSeq, StepOutput, StepPlan


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_k", 0, ">= 1"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("min_p", -0.1, "[0, 1]"),
    ("seed", -1, "[0, 2**63)"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"),
    ("max_tokens", 0, ">= 1"),
    ("logprobs", 21, "[0, 20]"),
    ("stop", ("",), "non-empty"),
    ("stop_token_ids", (-1,), ">= 0"),
])
def test_invalid_parameters_name_field_and_range(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert allowed in str(err.value)


def test_params_round_trip_and_unknown_field():
    p = SamplingParams(temperature=0.7, top_k=5, stop="END", stop_token_ids=[3], seed=9, logprobs=2)
    assert p.stop == ("END",) and SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ConfigError, match="temprature"):
        SamplingParams.from_dict({"temprature": 1.0})


def _rows(params, n, prompt=(), output=()):
    return [SamplingRow(params, list(prompt), list(output)) for _ in range(n)]


def _oracle_filter(logits, temperature, top_k, top_p, min_p):
    """Probabilities after temperature, top-k, top-p and min-p, one row, float64 Python."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order[: top_k or len(z)])
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    total = sum(w.values())
    mass, nucleus = 0.0, set()
    for i in order:
        if i not in keep:
            break
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += w[i] / total
    total = sum(w[i] for i in nucleus)
    p = {i: w[i] / total for i in nucleus}
    top = max(p.values())
    p = {i: v for i, v in p.items() if v >= min_p * top}
    total = sum(p.values())
    return [p.get(i, 0.0) / total for i in range(len(z))]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, None, 1.0, 0.0), (0.5, 3, 1.0, 0.0), (1.3, None, 0.6, 0.0), (1.0, None, 1.0, 0.2), (0.8, 4, 0.9, 0.05),
])
def test_filtered_distribution_matches_oracle(temperature, top_k, top_p, min_p):
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = torch.softmax(filter_logits(logits / temperature, _rows(params, 3)), dim=-1)
    for r in range(3):
        want = _oracle_filter(logits[r].tolist(), temperature, top_k, top_p, min_p)
        torch.testing.assert_close(got[r].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-5)


def test_draws_follow_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits / 0.9, dim=-1)
    n = 20000
    params = SamplingParams(temperature=0.9)
    tokens, _ = Sampler(seed=3)(logits.repeat(n, 1), _rows(params, n))
    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    want = logits.argmax(-1).tolist()
    assert Sampler()(logits, _rows(SamplingParams(temperature=0), 6))[0] == want
    assert Sampler()(logits, _rows(SamplingParams(temperature=2.0, top_k=1), 6))[0] == want


def test_greedy_ties_and_nan_pick_what_argmax_picks():
    """first_max_index replaces argmax (faster on CPU): the first of tied maxima, NaN as the largest.
    Oracle: a Python scan of each row."""
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(5))
    logits[3, [17, 900, 4000]] = 50.0  # three tied maxima: the first wins
    logits[7, :] = 1.0  # a constant row: index 0
    logits[9, [5, 30]] = float("nan")  # NaN counts as the largest: the first NaN
    logits[11, -1] = float("inf")
    want = []
    for row in logits.tolist():
        nan = [i for i, x in enumerate(row) if math.isnan(x)]
        want.append(nan[0] if nan else row.index(max(row)))
    assert want[3] == 17 and want[7] == 0 and want[9] == 5 and want[11] == 4095
    assert Sampler()(logits, _rows(SamplingParams(temperature=0), 64))[0] == want
    assert logits.argmax(-1).tolist() == want


def test_seeded_rows_reproduce_whatever_the_batch():
    logits = torch.randn(1, 400, generator=torch.Generator().manual_seed(4))
    seeded = SamplingRow(SamplingParams(seed=123), [1, 2], [5, 6, 7])
    alone = Sampler(seed=0)(logits, [seeded])[0]
    other = SamplingRow(SamplingParams(), [9], [])
    crowded = Sampler(seed=99)(torch.cat([torch.randn(2, 400), logits]), [other, other, seeded])[0]
    assert crowded[2] == alone[0]
    # The next token of the same request (one more output) draws fresh noise.
    draws = {Sampler()(logits, [SamplingRow(SamplingParams(seed=123), [1], list(range(k)))])[0][0]
             for k in range(40)}
    assert len(draws) > 5
    by_seed = {Sampler()(logits, [SamplingRow(SamplingParams(seed=s), [1], [])])[0][0] for s in range(40)}
    assert len(by_seed) > 5


def test_penalties_match_oracle():
    vocab = 10
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5)) * 3
    prompt, output = [1, 2, 2], [2, 3, 3, 3, 7]
    p = SamplingParams(temperature=0, repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)
    rows = [SamplingRow(p, prompt, output), SamplingRow(SamplingParams(temperature=0), prompt, output)]
    from meshserve.workers.sampler import apply_penalties

    got = apply_penalties(logits, rows)
    want = logits[0].tolist()
    for t in range(vocab):
        if t in prompt or t in output:
            want[t] = want[t] / 1.7 if want[t] > 0 else want[t] * 1.7
        c = output.count(t)
        want[t] -= 0.3 * c + (0.5 if c else 0.0)
    torch.testing.assert_close(got[0], torch.tensor(want), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], logits[1])  # no penalties: untouched


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    p = SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5)
    tokens, lps = Sampler()(logits, [SamplingRow(p, [1], []), SamplingRow(SamplingParams(), [1], [])])
    ref = torch.log_softmax(logits[0].double(), -1)
    assert lps[1] is None and lps[0].token_id == tokens[0]
    assert lps[0].logprob == pytest.approx(float(ref[tokens[0]]), abs=1e-5)
    top = ref.topk(3)
    assert [t for t, _ in lps[0].top] == top.indices.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_step_messages_round_trip_through_msgpack():
    seqs = [ScheduledSeq("a", [2, 3], 1, [[4, 5], [6, 7]], False), ScheduledSeq("b", [9], 10, [[1], [2]], True)]
    plan = StepPlan.from_seqs(7, seqs,
                    [NewRequest("a", [1, 2, 3], SamplingParams(seed=1).to_dict())], ["z"])
    assert StepPlan.from_msgpack(plan.to_msgpack()) == plan
    out = StepOutput.of(7, [SampledToken("a", 5, TokenLogprobs(5, -0.5, ((5, -0.5), (2, -1.5)))),
                         SampledToken("b", 1)])
    assert StepOutput.from_msgpack(out.to_msgpack()) == out


def test_token_counts_equal_a_counter_per_row():
    """The batched (row, token) bincount against collections.Counter, empty rows included."""
    import collections
    import random

    from meshserve.workers.sampler import _token_counts

    rng = random.Random(3)
    lists = [[rng.randrange(50) for _ in range(rng.choice([0, 1, 7, 40]))] for _ in range(9)] + [[]]
    counts = _token_counts(lists, 50, torch.device("cpu"))
    assert counts.shape == (10, 50) and counts.dtype == torch.float32
    for row, tokens in zip(counts.tolist(), lists):
        assert row == [float(collections.Counter(tokens)[t]) for t in range(50)]
