"""Turns a step's logits into next tokens: penalties, temperature, top-k/top-p/min-p, a draw.

Batched over rows; each row carries its own SamplingParams. Draws use the exponential race
(argmax of p / E with E ~ Exp(1)), which samples exactly from p. A seeded row draws E from a
generator seeded by (seed, index of the token being generated): the same request gives the
same tokens whatever else shares its batch, and again after it is preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.core.outputs import TokenLogprobs
from meshserve.core.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit generator seed for token `index` of a request seeded with `seed`."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64  # splitmix64 finaliser
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    """One sequence to sample: its settings and the tokens it has seen (for penalties and seeds)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


class Sampler:
    """Stateless apart from the generator used by rows without a seed."""

    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] float32, one row per entry of `rows`. Returns N token ids and logprobs."""
        wants_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[wants_logprobs], dim=-1) if wants_logprobs else None
        logits = apply_penalties(logits, rows)
        tokens = logits.argmax(dim=-1)  # greedy rows keep this
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if random_rows:
            tokens[random_rows] = self._draw(logits[random_rows], [rows[i] for i in random_rows])
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        for j, i in enumerate(wants_logprobs):
            logprobs[i] = _logprobs_of(raw_logprobs[j], token_list[i], rows[i].params.logprobs)
        return token_list, logprobs

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = filter_logits(logits / temperature[:, None], rows)
        probs = torch.softmax(logits, dim=-1)  # [n, V]
        noise = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for j, row in enumerate(rows):
            if row.params.seed is not None:
                gen = torch.Generator(probs.device).manual_seed(mix_seed(row.params.seed, len(row.output_ids)))
                noise[j].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties; new tensor."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    counts = _token_counts([rows[i].output_ids for i in idx], vocab, device)  # [n, V]
    seen = _token_counts([rows[i].prompt_ids for i in idx], vocab, device) > 0
    seen |= counts > 0

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(rows[i].params, name) for i in idx], device=device)[:, None]

    sub = logits[idx]
    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    out = logits.clone()
    out[idx] = sub
    return out


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, V] float32 occurrence counts (padding goes to an extra column that is dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for i, toks in enumerate(token_lists):
        if toks:
            padded[i, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def filter_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """top-k, then top-p, then min-p; removed tokens get -inf. logits: [n, V] (after temperature)."""
    vocab = logits.shape[1]
    device = logits.device
    top_k = [r.params.top_k or vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= torch.tensor(top_k, device=device)[:, None],
                                                  float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays (mass 0)
        drop = mass_before >= torch.tensor(top_p, device=device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    min_p = [r.params.min_p for r in rows]
    if any(p > 0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _logprobs_of(logprobs: torch.Tensor, token_id: int, n: int) -> TokenLogprobs:
    top = torch.topk(logprobs, n) if n else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprobs(token_id=token_id, logprob=float(logprobs[token_id]), top=pairs)
