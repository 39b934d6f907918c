"""Turns a step's logits into next tokens: penalties, temperature, top-k/top-p/min-p, a draw.

Batched over rows; each row carries its own SamplingParams. Draws use the exponential race
(argmax of p / E with E ~ Exp(1)), which samples exactly from p. A seeded row draws E from a
generator seeded by (seed, index of the token being generated): the same request gives the
same tokens whatever else shares its batch, and again after it is preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from meshserve.attention.backends.cpu_step_ops import argmax_rows, step_ops
from meshserve.core.outputs import TokenLogprobs
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.tensors import to_device
from meshserve.workers.constraints import RequestConstraints, apply_constraints

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """A well-spread 63-bit generator seed for token `index` of a request seeded with `seed`."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64  # splitmix64 finaliser
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    """One sequence to sample: its settings and the tokens it has seen (for penalties and seeds);
    constraints: its logit_bias / allowed ids / bad words / min_tokens / grammar (None: none)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    constraints: RequestConstraints | None = None


@dataclass
class Draw:
    """One step's draw, still on the device; its one device->host copy starts when it is made.

    tokens: [N] int64; chosen [W] float32 logprob of each logprobs row's token; top_values /
    top_ids [W, K] its K most likely (K = the largest n asked for); wants: (row, n) per logprobs row.

    On CUDA the copy into pinned host memory is queued right behind the draw, with an event after
    it: `to_host` waits for that event, i.e. for this step only. (Copying at `to_host` time would
    queue the copy behind whatever the host submitted since — under overlap scheduling the whole
    next step — and the host would wait for that too, leaving the device idle while it plans.)
    """

    tokens: torch.Tensor
    wants: list[tuple[int, int]]
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    _host: tuple[torch.Tensor | None, ...] = field(default=(), init=False, repr=False)
    _copied: torch.cuda.Event | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        parts = (self.tokens, self.chosen, self.top_values, self.top_ids)
        if not self.tokens.is_cuda:
            self._host = parts
            return
        self._host = tuple(None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                           for t in parts)
        for host, dev in zip(self._host, parts):
            if dev is not None:
                host.copy_(dev, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def is_ready(self) -> bool:
        """Whether `to_host` would return without waiting for the device (an event query)."""
        return self._copied is None or self._copied.query()

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._copied is not None:
            self._copied.synchronize()
        tokens, chosen, top_values, top_ids = self._host
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if self.wants:
            chosen = chosen.tolist()
            values, ids = top_values.tolist(), top_ids.tolist()
            for j, (i, n) in enumerate(self.wants):
                top = tuple(zip(ids[j][:n], values[j][:n]))
                logprobs[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen[j], top=top)
        return token_list, logprobs


class Sampler:
    """Stateless apart from the generator used by rows without a seed."""

    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] float32, one row per entry of `rows`. Returns N token ids and logprobs."""
        return self.draw(logits, rows).to_host()

    def draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow], *, constrained: bool | None = None) -> Draw:
        """The step's tokens (and logprobs) on the device, without waiting for them.
        constrained: whether any row has constraints (None: look; False skips the look)."""
        wants = [(i, r.params.logprobs) for i, r in enumerate(rows) if r.params.logprobs is not None]
        want_rows = to_device([i for i, _ in wants], logits.device) if wants else None
        raw_logprobs = torch.log_softmax(logits[want_rows], dim=-1) if wants else None
        logits = apply_penalties(logits, rows)
        if constrained is None:
            constrained = any(r.constraints is not None for r in rows)
        if constrained:
            logits = apply_constraints(logits, [r.constraints for r in rows])
        tokens = first_max_index(logits)  # greedy rows keep this
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if random_rows:
            at = to_device(random_rows, logits.device)
            tokens[at] = self._draw(logits[at], [rows[i] for i in random_rows])
        if not wants:
            return Draw(tokens, [])
        chosen = raw_logprobs.gather(1, tokens[want_rows][:, None])[:, 0]
        top = torch.topk(raw_logprobs, max(n for _, n in wants), dim=-1)
        return Draw(tokens, wants, chosen, top.values, top.indices)

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        temperature = to_device([r.params.temperature for r in rows], logits.device)
        logits = filter_logits(logits / temperature[:, None], rows)
        probs = torch.softmax(logits, dim=-1)  # [n, V]
        noise = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            fresh = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise[to_device(unseeded, probs.device)] = fresh.exponential_(generator=self.generator)
        for j, row in enumerate(rows):
            if row.params.seed is not None:
                gen = torch.Generator(probs.device).manual_seed(mix_seed(row.params.seed, len(row.output_ids)))
                noise[j].exponential_(generator=gen)
        return first_max_index(probs / noise)


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N] int64 index of each row's maximum, the first one on ties: argmax's result.

    On CPU the compiled `argmax_rows` (attention/backends/cpu_step_ops.py) for float32 rows,
    else `max(dim).indices`: the same index (the first maximum, NaN counting as the largest).
    torch's CPU reduction with indices is a scalar loop: on the Zen-4-class host 232 us for
    64 x 4096 logits and 63 at 16 rows (`max` and `argmax` alike), against about 10 and 3
    vectorised (docs/performance.md). Elsewhere argmax, whose GPU kernels the GPU tests have
    checked (the CPU timing says nothing about them).
    """
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    if x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous() and step_ops() is not None:
        return argmax_rows(x)
    return x.max(dim=-1).indices


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
        return to_device([getattr(rows[i].params, name) for i in idx], device)[:, None]

    at = to_device(idx, device)
    sub = logits[at]
    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    out = logits.clone()
    out[at] = sub
    return out


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, V] float32 occurrence counts: one bincount over (row, token) pairs built on the host
    without a loop over tokens (or a tensor per row)."""
    lengths = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
    tokens = np.fromiter(chain.from_iterable(token_lists), np.int64, int(lengths.sum()))
    flat = np.repeat(np.arange(len(token_lists)) * vocab, lengths) + tokens  # row * V + token
    counts = torch.bincount(to_device(torch.from_numpy(flat), device), minlength=len(token_lists) * vocab)
    return counts.view(len(token_lists), vocab).float()


def filter_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """top-k, then top-p, then min-p; removed tokens get -inf. logits: [n, V] (after temperature)."""
    vocab = logits.shape[1]
    device = logits.device
    top_k = [r.params.top_k or vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= to_device(top_k, device)[:, None],
                                                  float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays (mass 0)
        drop = mass_before >= to_device(top_p, device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    min_p = [r.params.min_p for r in rows]
    if any(p > 0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * to_device(min_p, device)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits
