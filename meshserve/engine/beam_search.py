"""Beam search inside an EngineCore, ranking beams as HF transformers does (core/beam_params.py).

A request whose `beam` is set is searched instead of sampled. Every beam is a scheduler request
(greedy, ignore_eos, logprobs = the step's candidate count K, `chosen_by_search`), so the
beams of every search share steps with every other request (continuous batching, chunked
prefill, preemption, overlap scheduling); the search only chooses what each beam continues with:
  1. A step computes each live beam's newest token and returns its top-K next tokens. The
     scheduler holds a beam from the step that samples it until its search has chosen (it is
     never scheduled past a token not chosen yet; a held beam yields its blocks to requests that
     can run, and is recomputed later).
  2. Once every live beam has its candidates, the K best continuations by cumulative logprob are
     ranked. The best beam_width that do not end are the next beams: a beam's first continuation
     reuses its request (the sampled last token is replaced: no step computed its K/V), each
     further one forks it (Scheduler.fork: blocks shared, the first write to the shared partial
     last block copies it). Beams with no continuation are aborted at once: blocks freed.
  3. Continuations that end (EOS, max_tokens) are scored and kept among the beam_width best
     finished; when HF's stopping rules end the search its live beams are aborted and its
     sequences come out as deltas, best first (index 0, 1, ...), the last one `finished`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.core.arith import cdiv
from meshserve.core.outputs import CompletionDelta, FinishReason
from meshserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from meshserve.engine.request import Request
from meshserve.errors import check


@dataclass
class _Finished:
    score: float
    cum_logprob: float
    token_ids: list[int]
    reason: FinishReason


class BeamSearch:
    """The beam search of one request inside an EngineCore (EngineCore.add of a request whose
    `beam` is set). `on_token` takes each beam's sampled step; when the search is done it returns
    the deltas of its sequences, best first (index 0..), the last one `finished`.

    owners: the engine's map from beam request id to its search, kept up to date as beams fork
    and are dropped.
    """

    def __init__(self, request: Request, *, scheduler, owners: dict[str, BeamSearch], eos_token_ids,
                 vocab_size: int, max_model_len: int, tokenizer) -> None:
        params = request.beam
        check(params is not None, "beam", None, "a request with BeamSearchParams")
        self.params = params
        self.scheduler = scheduler
        self.owners = owners
        self.tokenizer = tokenizer
        self.request_id = request.request_id
        eos = frozenset(eos_token_ids)
        self.eos = frozenset() if params.ignore_eos else eos
        self.k = min(params.candidates_per_step(len(eos)), vocab_size)
        per_width = cdiv(self.k, params.beam_width)
        check(self.k <= MAX_LOGPROBS, "beam_width", params.beam_width,
              f"an integer in [1, {MAX_LOGPROBS // per_width}] for this model ({per_width} candidates per beam "
              f"and step with its {len(eos)} EOS ids, at most {MAX_LOGPROBS} in all)")
        room = max_model_len - len(request.prompt_ids)
        check(params.max_tokens <= room, "max_tokens", params.max_tokens,
              f"an integer in [1, {room}]: max_model_len={max_model_len} minus the prompt's "
              f"{len(request.prompt_ids)} tokens")
        sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=self.k)
        self.root = Request(request.request_id + "/beam-0", request.prompt_ids, sampling, arrival=request.arrival,
                            prompt=request.prompt, chosen_by_search=True)
        self.beams = [self.root]
        self.cumulative = [0.0]
        self.finished: list[_Finished] = []
        self.num_generated = 0  # tokens of each live beam, its newest (being ranked) not counted
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False
        self._ids = 0

    @property
    def request_ids(self) -> list[str]:
        return [b.request_id for b in self.beams]

    def start(self, *, bounded: bool = True) -> None:
        self.scheduler.add_request(self.root, bounded=bounded)
        self.owners[self.root.request_id] = self

    def on_token(self, beam: Request) -> list[CompletionDelta]:
        """A beam received its candidates; ranks them once every live beam has."""
        if self.done or not all(b.held and not b.num_pending_outputs for b in self.beams):
            return []
        self._advance()
        return self._results() if self.done else []

    def abort(self) -> None:
        """Drop every live beam (their blocks are freed)."""
        self.done = True
        self._drop(self.beams)
        self.beams, self.cumulative = [], []

    def _advance(self) -> None:
        """Rank the live beams' continuations; continue, fork, finish and drop beams (HF's step)."""
        p = self.params
        width = p.beam_width
        length = self.num_generated + 1  # the newest token counted
        candidates = []  # (cumulative logprob, beam index, token)
        for b, (beam, cum) in enumerate(zip(self.beams, self.cumulative)):
            candidates += [(cum + lp, b, tok) for tok, lp in beam.output_logprobs[-1].top[: self.k]]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then rank order
        top = candidates[: self.k]
        ends = [tok in self.eos or length >= p.max_tokens for _, _, tok in top]
        # Finished: among the first beam_width only, while they can still count.
        full = len(self.finished) == width and p.early_stopping is True
        if self.improvable and not full:
            for (cum, b, tok), end in zip(top[:width], ends[:width]):
                if end:
                    tokens = self.beams[b].output_ids[:-1] + [tok]
                    reason = FinishReason.STOP if tok in self.eos else FinishReason.LENGTH
                    self.finished.append(_Finished(cum / length**p.length_penalty, cum, tokens, reason))
            self.finished.sort(key=lambda f: -f.score)
            del self.finished[width:]
        running = [c for c, end in zip(top, ends) if not end][:width]
        self.num_generated = length
        if self.improvable:
            self.improvable = len(self.finished) < width or (
                bool(running) and running[0][0] / self._best_length(length) ** p.length_penalty
                > self.finished[-1].score)
        stop = (not self.improvable or not running
                or (len(self.finished) == width and p.early_stopping is True))
        if stop:
            self.abort()
            return
        self._continue(running)

    def _best_length(self, length: int) -> int:
        if self.params.early_stopping == "never" and self.params.length_penalty > 0:
            return self.params.max_tokens
        return length

    def _continue(self, running: list[tuple[float, int, int]]) -> None:
        """The next live beams: (cumulative logprob, parent beam, token) each."""
        old = self.beams
        prefixes = [beam.output_ids[:-1] for beam in old]
        reused: set[int] = set()
        beams, cumulative, forks = [], [], []
        for cum, b, tok in running:
            parent = old[b]
            if b not in reused:
                reused.add(b)
                beams.append(parent)
                parent.replace_last_output(tok)
            else:
                self._ids += 1
                child = Request(f"{self.request_id}/beam-{self._ids}", parent.prompt_ids, parent.params,
                                arrival=parent.arrival, prompt=parent.prompt, output_ids=prefixes[b] + [tok],
                                chosen_by_search=True)
                forks.append((parent, child))
                beams.append(child)
            cumulative.append(cum)
        # Fork before any parent is dropped: a child shares its parent's computed blocks.
        for parent, child in forks:
            child.held = True
            self.scheduler.fork(parent, child)
            self.owners[child.request_id] = self
        self._drop([beam for b, beam in enumerate(old) if b not in reused])
        for beam in beams:
            beam.held = False
        self.beams, self.cumulative = beams, cumulative

    def _drop(self, beams: Sequence[Request]) -> None:
        for beam in beams:
            beam.held = False
            self.scheduler.abort(beam.request_id)
            self.owners.pop(beam.request_id, None)

    def _results(self) -> list[CompletionDelta]:
        tokenizer = self.tokenizer
        skip = self.params.skip_special_tokens
        last = len(self.finished) - 1
        return [
            CompletionDelta(self.request_id, f.token_ids,
                            tokenizer.decode(f.token_ids, skip_special_tokens=skip) if tokenizer is not None else "",
                            i == last, f.reason, index=i, cumulative_logprob=f.cum_logprob)
            for i, f in enumerate(self.finished)
        ]  # fmt: skip
