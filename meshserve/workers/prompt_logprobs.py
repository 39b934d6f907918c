"""Logprobs of a prompt's own tokens (SamplingParams.prompt_logprobs), from a step's hidden states.

A step computes the hidden state of every new token, but the runner turns only the sampled
rows into logits. For a request asking for prompt logprobs, the hidden state at prompt
position p also gives the distribution of token p + 1: those rows go through the LM head too
(every rank: a vocabulary-parallel head gathers collectively), in slices of ROWS_PER_SLICE so
that a long prompt chunk never holds [chunk, vocab] logits at once. The prompt's last position
predicts the first output token (the sampler's row), so it is left out. The scheduler gives such
requests no prefix-cache hit, so every position is computed once (again after a preemption;
the engine keeps the first value of each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from meshserve.core.outputs import TokenLogprobs
from meshserve.core.tensors import to_device

ROWS_PER_SLICE = 256

# request id -> [(index of the prompt token, its logprobs), ...]
PromptLogprobs = dict[str, list[tuple[int, TokenLogprobs]]]


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    wanted: Sequence[tuple[str, int, int, int, Sequence[int], int]]) -> PromptLogprobs:
    """hidden: [T, H] the step's hidden states (packed). wanted: per sequence asking for them,
    (request id, row of its first new token in `hidden`, context_len, new tokens, prompt ids, top n).
    Returns, per request, the logprobs of prompt tokens context_len + 1 .. (at most the prompt's last)."""
    rows, targets, owners, n_top = [], [], [], 0
    for rid, start, context, num_new, prompt, n in wanted:
        last = min(context + num_new, len(prompt) - 1)  # positions p < last predict prompt token p + 1
        for p in range(context, last):
            rows.append(start + p - context)
            targets.append(prompt[p + 1])
            owners.append((rid, p + 1, n))
        n_top = max(n_top, n)
    out: PromptLogprobs = {}
    if not rows:
        return out
    device = hidden.device
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        at = to_device(rows[lo:lo + ROWS_PER_SLICE], device)
        want = to_device(targets[lo:lo + ROWS_PER_SLICE], device)
        logprobs = torch.log_softmax(compute_logits(hidden[at]).float(), dim=-1)  # [r, V]
        chosen = logprobs.gather(1, want[:, None])[:, 0].tolist()
        top = torch.topk(logprobs, n_top, dim=-1) if n_top else None
        values = top.values.tolist() if top is not None else [[]] * len(chosen)
        ids = top.indices.tolist() if top is not None else [[]] * len(chosen)
        for j, (rid, index, n) in enumerate(owners[lo:lo + ROWS_PER_SLICE]):
            lp = TokenLogprobs(targets[lo + j], chosen[j], tuple(zip(ids[j][:n], values[j][:n])))
            out.setdefault(rid, []).append((index, lp))
    return out


def wanted_rows(ids: Sequence[str], context_lens: Sequence[int], query_lens: Sequence[int], ends: np.ndarray,
                requests) -> list:
    """The `wanted` argument of prompt_logprobs for a step's rows (request `ids[s]` with
    `context_lens[s]` tokens cached, packed in that order; `ends` [S] the row of each one's last
    new token), from the runner's requests."""
    out = []
    for s, rid in enumerate(ids):
        req = requests[rid]
        n = req.params.prompt_logprobs
        context = int(context_lens[s])
        if n is not None and context < len(req.prompt_ids) - 1:
            q = int(query_lens[s])
            out.append((rid, int(ends[s]) - q + 1, context, q, req.prompt_ids, n))
    return out
