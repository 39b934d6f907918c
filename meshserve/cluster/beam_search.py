"""Beam search over one EngineCore's scheduler, as HF transformers ranks beams (core/beam_params.py).

Every beam is a scheduler request (greedy, ignore_eos, logprobs = the step's candidate count K),
so the scheduler batches the beams of every prompt with continuous batching, chunked prefill and
preemption as usual; the search only chooses what each beam continues with:
  1. A step computes each live beam's newest token and returns its top-K next tokens; the beam
     is then `held` (not scheduled) until every live beam of its prompt has its candidates
     (a preempted beam is recomputed first).
  2. The K best continuations by cumulative logprob are ranked. The best beam_width that do not
     end become the next beams: a beam's first continuation reuses its request (the sampled last
     token is replaced: its K/V is not computed yet), each further one forks it
     (Scheduler.fork: the blocks are shared, the first write to the shared partial last block
     copies it). Beams with no continuation are aborted at once, which frees their blocks.
  3. Continuations that end (EOS, max_tokens) are scored and kept among the beam_width best
     finished; the prompt is done by HF's stopping rules, and its live beams are aborted.
The search steps the engine synchronously: a beam's next token is chosen on the host between
steps, so no step may be planned ahead of that choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshserve.cluster.request import Request
from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.outputs import BeamSearchOutput, BeamSequence, FinishReason
from meshserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from meshserve.errors import check

_OUT = -1.0e9  # HF's score for "cannot be chosen"


@dataclass
class _Finished:
    score: float
    cum_logprob: float
    token_ids: list[int]
    reason: FinishReason


@dataclass
class _Search:
    """One prompt's search: live beams (requests) with their cumulative logprobs, and the best
    finished sequences so far (at most beam_width, best first)."""

    root: Request
    beams: list[Request]
    cumulative: list[float]
    finished: list[_Finished] = field(default_factory=list)
    num_generated: int = 0  # tokens of each live beam, its newest (being ranked) not counted
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False


class BeamSearch:
    """Runs `LLM.beam_search` on an idle EngineCore: `run(requests)` -> one output per request."""

    def __init__(self, core, params: BeamSearchParams) -> None:
        self.core = core
        self.params = params
        self.scheduler = core.scheduler
        eos = core.info.eos_token_ids
        self.eos = frozenset() if params.ignore_eos else frozenset(eos)
        self.k = min(params.candidates_per_step(len(set(eos))), core.info.vocab_size)
        per_width = self.k // params.beam_width
        check(self.k <= MAX_LOGPROBS, "beam_width", params.beam_width,
              f"an integer in [1, {MAX_LOGPROBS // per_width}] for this model ({per_width} candidates per beam "
              f"and step with its {len(self.eos)} EOS ids, at most {MAX_LOGPROBS})")
        self.sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                       logprobs=self.k, skip_special_tokens=params.skip_special_tokens)
        self._ids = 0

    def requests_for(self, requests: Sequence[Request]) -> list[Request]:
        """The roots to search from (the prompts' checked requests, with the search's settings);
        refuses a prompt whose beams could outgrow the context."""
        limit = self.core.info.max_model_len
        for req in requests:
            room = limit - len(req.prompt_ids)
            check(self.params.max_tokens <= room, "max_tokens", self.params.max_tokens,
                  f"an integer in [1, {room}]: max_model_len={limit} minus the prompt's {len(req.prompt_ids)} tokens")
        return [Request(r.request_id, r.prompt_ids, self.sampling, arrival=r.arrival, prompt=r.prompt)
                for r in requests]

    def run(self, requests: Sequence[Request]) -> list[BeamSearchOutput]:
        roots = self.requests_for(requests)
        searches = [_Search(root, [root], [0.0]) for root in roots]
        for root in roots:
            self.scheduler.add_request(root, bounded=False)
        try:
            while not all(s.done for s in searches):
                step = self.scheduler.schedule()
                check(not step.is_empty, "beam_search", "no progress", "a KV pool that holds one beam")
                for req in self.scheduler.update(step, self.core.executor.execute_step(step.plan)):
                    req.held = True
                for search in searches:
                    if not search.done and all(b.held for b in search.beams):
                        self._advance(search)
        finally:  # on an error too: no beam keeps its blocks
            for search in searches:
                self._drop(search.beams)
                search.beams = []
        return [self._output(s) for s in searches]

    def _advance(self, search: _Search) -> None:
        """Rank the live beams' continuations; continue, fork, finish and drop beams (HF's step)."""
        p = self.params
        width = p.beam_width
        length = search.num_generated + 1  # the newest token counted
        candidates = []  # (cumulative logprob, beam index, token)
        for b, (beam, cum) in enumerate(zip(search.beams, search.cumulative)):
            candidates += [(cum + lp, b, tok) for tok, lp in beam.output_logprobs[-1].top[: self.k]]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam, then rank order
        top = candidates[: self.k]
        ends = [tok in self.eos or length >= p.max_tokens for _, _, tok in top]
        # Finished: among the first beam_width only, while they can still count.
        full = len(search.finished) == width and p.early_stopping is True
        if search.improvable and not full:
            for (cum, b, tok), end in zip(top[:width], ends[:width]):
                if end:
                    tokens = search.beams[b].output_ids[:-1] + [tok]
                    reason = FinishReason.STOP if tok in self.eos else FinishReason.LENGTH
                    search.finished.append(_Finished(cum / length**p.length_penalty, cum, tokens, reason))
            search.finished.sort(key=lambda f: -f.score)
            del search.finished[width:]
        running = [c for c, end in zip(top, ends) if not end][:width]
        search.num_generated = length
        if search.improvable:
            search.improvable = len(search.finished) < width or (
                bool(running) and running[0][0] / self._best_length(length) ** p.length_penalty
                > search.finished[-1].score)
        stop = (not search.improvable or not running
                or (len(search.finished) == width and p.early_stopping is True))
        if stop:
            search.done = True
            self._drop(search.beams)
            search.beams, search.cumulative = [], []
            return
        self._continue(search, running)

    def _best_length(self, length: int) -> int:
        if self.params.early_stopping == "never" and self.params.length_penalty > 0:
            return self.params.max_tokens
        return length

    def _continue(self, search: _Search, running: list[tuple[float, int, int]]) -> None:
        """The next live beams: (cumulative logprob, parent beam, token) each."""
        old = search.beams
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
                child = Request(f"{search.root.request_id}/beam-{self._ids}", parent.prompt_ids, parent.params,
                                arrival=parent.arrival, prompt=parent.prompt, output_ids=prefixes[b] + [tok])
                forks.append((parent, child))
                beams.append(child)
            cumulative.append(cum)
        # Fork before any parent is dropped: a child shares its parent's computed blocks.
        for parent, child in forks:
            child.held = True
            self.scheduler.fork(parent, child)
        self._drop([beam for b, beam in enumerate(old) if b not in reused])
        for beam in beams:
            beam.held = False
        search.beams, search.cumulative = beams, cumulative

    def _drop(self, beams: Sequence[Request]) -> None:
        for beam in beams:
            beam.held = False
            self.scheduler.abort(beam.request_id)

    def _output(self, search: _Search) -> BeamSearchOutput:
        tokenizer = self.core.tokenizer
        skip = self.params.skip_special_tokens
        sequences = [
            BeamSequence(f.token_ids, f.cum_logprob, f.score,
                         tokenizer.decode(f.token_ids, skip_special_tokens=skip) if tokenizer is not None else "",
                         f.reason)
            for f in search.finished
        ]  # fmt: skip
        return BeamSearchOutput(search.root.prompt, list(search.root.prompt_ids), sequences)
