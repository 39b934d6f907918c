"""n / best_of: one request sampled as several sequences over one copy of its prompt's KV.

The client's request becomes `best_of` (else n) sample requests `{id}/0`, `{id}/1`, ..., each an
independent draw (with a seed, sample i draws with seed + i, so the group is reproducible), and a
prompt-only root `{id}/prompt` that computes the K/V of every prompt token but the last and samples
nothing. The step that schedules the root's last prompt tokens makes the scheduler fork the samples
off the root's blocks and drop the root (Scheduler._fork_groups): the samples share every prompt
block; each computes the prompt's last token itself, so its first write copies the shared
partial last block (copy-on-write) and its first token is its own draw. A one-token prompt has no
root: its samples are queued as they are.

`SampleGroup.on_delta` turns a sample's delta into what the client sees under its own id, with
`index`: every sample streams as it goes when best_of == n; with best_of > n nothing streams until
every sample ended, then the n with the highest cumulative logprob come, best first, each whole.

prompt_logprobs are the same for every sample, so they are computed once, by the root (the
workers see its samples' whole prompt: the logits at its last position give the prompt's last
token's logprob), and come once per request, as vLLM returns them: on the group's first delta.
The samples do not ask for them (a preempted sample recomputes its prompt without them).
"""

from __future__ import annotations

from dataclasses import replace

from meshserve.core.outputs import CompletionDelta, TokenLogprobs
from meshserve.engine.request import Request

_SEED_SPAN = 2**63


class SampleGroup:
    """The sample requests of one client request with num_samples > 1, and its output state."""

    def __init__(self, request: Request) -> None:
        p = request.params
        rid = request.request_id
        self.request_id = rid
        self.n = p.n
        self.wants_logprobs = p.logprobs is not None
        self.ranks = p.num_samples > p.n  # best_of > n: keep the n best by cumulative logprob
        logprobs = p.logprobs if p.logprobs is not None else (0 if self.ranks else None)
        self.samples = [
            Request(f"{rid}/{i}", list(request.prompt_ids),
                    replace(p, n=1, best_of=None, logprobs=logprobs, prompt_logprobs=None,
                            seed=None if p.seed is None else (p.seed + i) % _SEED_SPAN),
                    arrival=request.arrival, prompt=request.prompt)
            for i in range(p.num_samples)
        ]  # fmt: skip
        self.index = {s.request_id: i for i, s in enumerate(self.samples)}
        self.root: Request | None = None
        if len(request.prompt_ids) > 1:
            self.root = Request(f"{rid}/prompt", list(request.prompt_ids[:-1]),
                                replace(self.samples[0].params, prompt_logprobs=p.prompt_logprobs),
                                arrival=request.arrival, prompt=request.prompt, fork_into=self.samples)
        self.num_prompt_tokens = len(request.prompt_ids)
        self._owes_prompt_logprobs = p.prompt_logprobs is not None  # until the group's first delta
        self.cumulative = [0.0] * len(self.samples)
        self.has_logprobs = logprobs is not None
        self.num_open = len(self.samples)
        self._whole = [CompletionDelta(rid, [], "", index=i) for i in range(len(self.samples))] if self.ranks else []

    @property
    def request_ids(self) -> list[str]:
        """Every id the scheduler may hold for this group (root first)."""
        return ([self.root.request_id] if self.root is not None else []) + list(self.index)

    @property
    def done(self) -> bool:
        return self.num_open == 0

    def prompt_logprobs(self) -> list[TokenLogprobs | None]:
        """Per prompt token (None for the first, which nothing predicts), as the root computed them."""
        found = self.root.prompt_logprobs if self.root is not None else {}
        return [None] + [found.get(i) for i in range(1, self.num_prompt_tokens)]

    def _with_prompt_logprobs(self, out: list[CompletionDelta]) -> list[CompletionDelta]:
        """`out`, its first delta carrying the prompt logprobs when they are owed (once per request)."""
        if self._owes_prompt_logprobs and out:
            self._owes_prompt_logprobs = False
            out[0] = replace(out[0], prompt_logprobs=self.prompt_logprobs())
        return out

    def on_delta(self, delta: CompletionDelta) -> list[CompletionDelta]:
        """What the client gets, under the group's id, for one sample's delta."""
        i = self.index[delta.request_id]
        self.cumulative[i] += sum(lp.logprob for lp in delta.logprobs)
        ended = delta.finish_reason is not None
        self.num_open -= ended
        cumulative = self.cumulative[i] if ended and self.has_logprobs else None
        logprobs = delta.logprobs if self.wants_logprobs else []
        if not self.ranks:
            return self._with_prompt_logprobs([CompletionDelta(
                self.request_id, delta.token_ids, delta.text, self.done, delta.finish_reason, delta.stop_reason,
                logprobs, index=i, cumulative_logprob=cumulative, num_cached_tokens=delta.num_cached_tokens)])
        whole = self._whole[i]
        whole.token_ids += delta.token_ids
        whole.text += delta.text
        whole.logprobs += logprobs
        whole.finish_reason, whole.stop_reason, whole.cumulative_logprob = (delta.finish_reason, delta.stop_reason,
                                                                            cumulative)
        if not self.done:
            return []
        best = sorted(range(len(self.samples)), key=lambda j: -self.cumulative[j])[: self.n]
        return self._with_prompt_logprobs([replace(self._whole[j], index=k, finished=k == self.n - 1)
                                           for k, j in enumerate(best)])
