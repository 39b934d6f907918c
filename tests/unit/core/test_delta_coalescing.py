"""core/delta_coalescing.py: a lagging stream's queued deltas join without changing what it says.

The oracle is the uncoalesced sequence itself: per completion, the concatenated tokens, text and
logprobs are the same, every finish_reason and error stays where it was, and nothing joins
across the end of a completion."""

from __future__ import annotations

import dataclasses

import pytest

from meshserve.core import delta_coalescing
from meshserve.core.delta_coalescing import coalesce
from meshserve.core.outputs import CompletionDelta, FinishReason, TokenLogprobs


def d(tokens, *, index=0, finish=None, finished=False, lp=False, cum=None, rid="r"):
    logprobs = [TokenLogprobs(t, -0.5 * t, ((t, -0.5 * t),)) for t in tokens] if lp else []
    return CompletionDelta(rid, list(tokens), "".join(f" t{t}" for t in tokens), finished, finish, None, logprobs,
                           index, cum)


def said(items):
    """Per completion its tokens and logprobs; and in order, every end and error with the number of
    tokens sent before it."""
    tokens, logprobs, events = {}, {}, []
    for item in items:
        if isinstance(item, BaseException):
            events.append(("error", str(item), sum(map(len, tokens.values()))))
            continue
        tokens.setdefault(item.index, []).extend(item.token_ids)
        logprobs.setdefault(item.index, []).extend(item.logprobs)
        if item.finish_reason is not None or item.finished:
            events.append((item.index, item.finish_reason, item.finished, item.cumulative_logprob,
                           sum(map(len, tokens.values()))))
    return tokens, logprobs, events


CASES = {
    "one step per delta": [d([5]), d([6]), d([7]), d([8], finish=FinishReason.LENGTH, finished=True)],
    "with logprobs": [d([5], lp=True), d([6], lp=True), d([7], lp=True, finish=FinishReason.STOP, finished=True,
                                                        cum=-9.0)],
    "n=2 interleaved": [d([1], index=0), d([2], index=1), d([3], index=1), d([4], index=1, finish=FinishReason.STOP),
                        d([5], index=0), d([6], index=0, finish=FinishReason.LENGTH, finished=True)],
    "an error after tokens": [d([1]), d([2]), RuntimeError("replica died"), d([3])],
    "empty deltas": [d([]), d([4]), d([])],
}


@pytest.mark.parametrize("name", CASES)
def test_coalescing_keeps_what_the_stream_says(name):
    items = CASES[name]
    joined = coalesce(items)
    assert said(joined) == said(items)
    texts = {}
    for item in items:
        if isinstance(item, CompletionDelta):
            texts[item.index] = texts.get(item.index, "") + item.text
    for item in joined:
        if isinstance(item, CompletionDelta):
            texts[item.index] = texts[item.index].removeprefix(item.text)
    assert set(texts.values()) == {""}


def test_a_run_of_one_completions_steps_becomes_one_delta_ending_where_the_last_did():
    joined = coalesce(CASES["one step per delta"])
    assert len(joined) == 1
    (one,) = joined
    assert (one.token_ids, one.text, one.finish_reason, one.finished) == (
        [5, 6, 7, 8], " t5 t6 t7 t8", FinishReason.LENGTH, True)


def test_nothing_joins_past_the_end_of_a_completion_or_an_error():
    joined = coalesce(CASES["n=2 interleaved"])
    assert [(j.index, j.token_ids) for j in joined] == [(0, [1]), (1, [2, 3, 4]), (0, [5, 6])]
    joined = coalesce(CASES["an error after tokens"])
    assert [type(j).__name__ for j in joined] == ["CompletionDelta", "RuntimeError", "CompletionDelta"]
    assert joined[0].token_ids == [1, 2]


def test_joining_leaves_the_queued_deltas_untouched():
    items = [d([5]), d([6])]
    coalesce(items)
    assert [i.token_ids for i in items] == [[5], [6]]


def test_every_field_of_a_delta_has_a_way_to_join():
    known = (delta_coalescing.APPENDED + delta_coalescing.FROM_FIRST + delta_coalescing.FROM_LAST
             + delta_coalescing.LAST_SET)
    assert sorted(known) == sorted(f.name for f in dataclasses.fields(CompletionDelta))


def test_the_first_deltas_prompt_logprobs_and_the_last_deltas_state_survive_a_join():
    prompt_lps = [None, TokenLogprobs(7, -1.0, ())]
    first = dataclasses.replace(d([5]), prompt_logprobs=prompt_lps, num_cached_tokens=16)
    last = dataclasses.replace(d([6], finish=FinishReason.STOP, finished=True, cum=-3.0), num_cached_tokens=16)
    (one,) = coalesce([first, d([9]), last])
    assert (one.prompt_logprobs, one.num_cached_tokens, one.cumulative_logprob, one.token_ids) == (
        prompt_lps, 16, -3.0, [5, 9, 6])
