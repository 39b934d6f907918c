"""One replica: scheduler + executor + detokenizer. `step()` = schedule, run, postprocess.

The executor is how step plans reach the workers: in this process by default (engine/local_executor.py,
a method call on one Worker), or any executor of cluster/executors/ (ranks on threads, subprocesses or
Ray actors, and the in-process one that also answers KV hand-over calls). `detach` and `adopt` move a
request between replicas (disaggregated prefill and decode).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.checkpoint_files import load_tokenizer
from meshserve.core.outputs import CompletionDelta, CompletionOutput, FinishReason, RequestOutput
from meshserve.core.sampling_params import SamplingParams
from meshserve.engine.admission import RequestValidator
from meshserve.engine.beam_search import BeamSearch
from meshserve.engine.detokenizer import IncrementalDetokenizer
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.local_executor import LocalExecutor
from meshserve.engine.request import Request, RequestStatus
from meshserve.engine.sample_group import SampleGroup
from meshserve.engine.scheduler import ScheduledStep, Scheduler
from meshserve.engine.token_bytes import TokenBytes
from meshserve.engine.warmup import WarmupReport, wants_warmup, warm_up
from meshserve.errors import check
from meshserve.kvstore.manager import KVCacheManager
from meshserve.kvstore.retention import RetentionPolicy
from meshserve.workers.step import StepOutput
from meshserve.workers.worker import WorkerInfo

log = logging.getLogger("meshserve.engine")


def _decode_only(step: ScheduledStep) -> bool:
    """A step of rows that each compute one token (no prompt being prefilled, no grammar poll)."""
    return bool(step.requests) and not step.polls and all(n == 1 for _, n in step.requests)


def kv_manager_for(info: WorkerInfo, *, enable_prefix_caching: bool) -> KVCacheManager:
    """The block bookkeeping for a replica's workers: one block table per request and KV layer
    group of the workers' layout (info.kv_groups)."""
    retentions = [RetentionPolicy(w, s) for w, s in info.kv_groups]
    # Encoder-decoder models: a decoder block's K/V depend on the encoder input, which its hash
    # does not cover; their requests never look up, so hashing would only keep dead blocks cached.
    return KVCacheManager(info.num_kv_blocks, info.block_size, retentions=retentions,
                          enable_prefix_caching=enable_prefix_caching and not info.is_encoder_decoder)


@dataclass
class _Tracked:
    """Output-side state of one request."""

    request: Request
    detok: IncrementalDetokenizer | None
    num_sent_tokens: int = 0


class EngineCore:
    """Add requests, call `step()` until `has_unfinished()` is False; each step returns deltas."""

    def __init__(self, config: EngineConfig, *, executor=None, kv: KVCacheManager | None = None,
                 device: str | None = None, progress: bool = True) -> None:
        self.config = config
        self.executor = executor or LocalExecutor(config, device=device, progress=progress)
        self.info = self.executor.start()
        self.tokenizer = load_tokenizer(config.model.model)
        self.token_bytes = TokenBytes.of(self.tokenizer)  # streaming text without DecodeStream (byte-level BPE)
        self.kv = kv or kv_manager_for(self.info, enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, max_model_len=self.info.max_model_len,
                                   eos_token_ids=self.info.eos_token_ids)
        self.validator = RequestValidator.of_model(self.tokenizer, self.info, config.scheduler)
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, SampleGroup] = {}  # n / best_of requests by client id
        self._group_of: dict[str, SampleGroup] = {}  # ... by the ids of their unfinished samples
        self._searches: dict[str, BeamSearch] = {}  # beam searches by client id
        self._search_of: dict[str, BeamSearch] = {}  # ... by the ids of their live beams
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        # Overlap scheduling: the next step is planned and submitted while this one runs, with
        # executors that can submit a step before collecting the previous one. Unset, only
        # where the submit returns before the step is done (CUDA): on a CPU the submit of step N+1
        # computes it whole before step N's tokens are read, which delays every token by a step
        # (a request's first one too: docs/performance.md, "Served time to first token").
        wanted = config.scheduler.async_scheduling
        can = callable(getattr(self.executor, "submit_step", None))
        self.overlap = can and (wanted if wanted is not None else bool(getattr(self.executor, "runs_async", False)))
        self._in_flight: ScheduledStep | None = None  # submitted, results not applied yet
        # Overlap: how long the last step() waited in collect for the device, where the step it
        # collected and the one it submitted were both decode-only (else None): the host's slack
        # in a steady decode, which the replica's paced overlap spends waiting for arrivals.
        self.decode_slack_s: float | None = None
        self.collected_at = 0.0  # time.monotonic() at the last collect's return: the step in flight runs from then
        self._carried: list[CompletionDelta] = []  # deltas of a step applied between two step() calls
        self.warmup: WarmupReport | None = None  # set where the warm-up ran (engine/warmup.py)
        if wants_warmup(config.model.warmup, self.info.device):
            try:
                self.warmup = warm_up(self)
            except BaseException:  # a kernel that cannot run fails the start, with no rank left behind
                self.executor.shutdown()
                raise

    # -- requests --------------------------------------------------------------------------

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None, beam: BeamSearchParams | None = None) -> Request:
        """Tokenize and validate (admission.py); nothing is queued (errors leave no state behind).
        beam: a beam search (params None), checked against this model too."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = self.validator.make(prompt, params, request_id=rid, arrival=next(self._arrivals), beam=beam)
        self.scheduler.check_request(req)
        if beam is not None:
            self._search_for(req)  # its checks only: nothing is queued
        return req

    def _search_for(self, request: Request) -> BeamSearch:
        return BeamSearch(request, scheduler=self.scheduler, owners=self._search_of,
                          eos_token_ids=self.info.eos_token_ids, vocab_size=self.info.vocab_size,
                          max_model_len=self.info.max_model_len, tokenizer=self.tokenizer)

    def add(self, request: Request, *, bounded: bool = True) -> None:
        """Queue a request made by `make_request`; bounded=False: its caller bounds the queue.
        n / best_of > 1: its samples share the prompt's blocks (sample_group.py); deltas carry
        the request's id and the sample's index."""
        if request.beam is not None:
            check(request.request_id not in self._searches, "request_id", request.request_id, "an id not in use")
            search = self._search_for(request)
            search.start(bounded=bounded)
            self._searches[request.request_id] = search
            return
        if request.params.num_samples > 1:
            self._add_group(SampleGroup(request), bounded=bounded)
            return
        self.scheduler.add_request(request, bounded=bounded)
        self._tracked[request.request_id] = _Tracked(request, self._detokenizer(request))

    def _add_group(self, group: SampleGroup, *, bounded: bool) -> None:
        check(group.request_id not in self._groups, "request_id", group.request_id, "an id not in use")
        for rid in group.request_ids:
            check(rid not in self.scheduler.requests, "request_id", rid, "an id not in use")
        queued = [group.root] if group.root is not None else group.samples  # a root forks the samples
        for i, req in enumerate(queued):
            self.scheduler.add_request(req, bounded=bounded and i == 0)  # the group counts once in the queue
        for sample in group.samples:
            self._tracked[sample.request_id] = _Tracked(sample, self._detokenizer(sample))
            self._group_of[sample.request_id] = group
        self._groups[group.request_id] = group

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        p = request.params
        return IncrementalDetokenizer(self.tokenizer, request.prompt_ids, stop=p.stop,
                                      skip_special_tokens=p.skip_special_tokens,
                                      include_stop_str_in_output=p.include_stop_str_in_output,
                                      token_bytes=self.token_bytes)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> Request:
        req = self.make_request(prompt, params, request_id=request_id)
        self.add(req)
        return req

    def abort(self, request_id: str) -> CompletionDelta | None:
        search = self._searches.pop(request_id, None)
        if search is not None:
            search.abort()
            return CompletionDelta(request_id, [], "", True, FinishReason.ABORT)
        group = self._groups.pop(request_id, None)
        if group is not None:
            for rid in group.request_ids:
                self.scheduler.abort(rid)
                self._tracked.pop(rid, None)
                self._group_of.pop(rid, None)
            return CompletionDelta(request_id, [], "", True, FinishReason.ABORT)
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self._tracked.pop(request_id, None)
        return CompletionDelta(request_id, [], "", True, FinishReason.ABORT)

    @property
    def step_in_flight(self) -> bool:
        """Overlap: a step with rows is submitted and its results not collected yet (the device
        runs it; a step that only polls for grammars has nothing to run)."""
        return self._in_flight is not None and bool(self._in_flight.requests)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._carried)

    def detach(self, request_id: str) -> Request:
        """Take a request off this replica without finishing it (hand-over); its blocks are freed
        here (pin them first to keep its KV). No delta is produced."""
        check(request_id not in self._groups and request_id not in self._searches, "request_id", request_id,
              "a request with n = best_of = 1 and no beam search (those stay on their replica)")
        self.drain()
        self._tracked.pop(request_id, None)
        return self.scheduler.detach(request_id)

    def drain(self) -> None:
        """Wait for the step in flight and apply it; its deltas come with the next step()."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._carried += self._apply(step, self.executor.collect_step())

    def adopt(self, request: Request, *, num_computed_tokens: int = 0) -> None:
        """Continue a request started elsewhere, whose output_ids were already streamed.

        num_computed_tokens > 0: its KV for that many tokens is already in this replica's cache
        (kv.allocate_for_import); 0: the prompt and the output so far are recomputed.
        """
        request.arrival = next(self._arrivals)
        if num_computed_tokens:
            self.scheduler.add_running(request, num_computed_tokens)
        else:
            self.scheduler.add_request(request, bounded=False)
        tracked = _Tracked(request, self._detokenizer(request), num_sent_tokens=len(request.output_ids))
        if tracked.detok is not None:  # replay what the client already has, so text continues seamlessly
            tracked.detok.replay(request.output_ids)
        self._tracked[request.request_id] = tracked

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[CompletionDelta]:
        """Schedule and run one step; returns the deltas of the step whose results came back.

        With overlap the step scheduled here is submitted before the previous one is collected:
        the host plans step N+1 while the device runs step N, and the deltas returned are step
        N's. A request that step N finishes may still be in step N+1, whose token for it is dropped.
        A request whose grammar did not compile ends with a delta whose `error` is set (finish
        reason ERROR); while requests wait for their grammars, a step may carry no rows (it
        polls the driver rank, which waits a moment for a compile when there is nothing to run).
        """
        deltas, self._carried = self._carried, []
        step = self.scheduler.schedule()
        if not self.overlap:
            if not step.is_empty:
                deltas += self._apply(step, self.executor.execute_step(step.plan))
            return deltas
        if not step.is_empty:
            self.executor.submit_step(step.plan)
        previous, self._in_flight = self._in_flight, (None if step.is_empty else step)
        self.decode_slack_s = None
        if previous is not None:
            started = time.monotonic()
            output = self.executor.collect_step()
            self.collected_at = time.monotonic()
            if _decode_only(previous) and _decode_only(step):
                self.decode_slack_s = self.collected_at - started
            deltas += self._apply(previous, output)
        return deltas

    def _apply(self, step: ScheduledStep, output: StepOutput) -> list[CompletionDelta]:
        touched = self.scheduler.update(step, output)
        if not self._group_of and not self._search_of:  # no n > 1 groups, no live beams: one delta each
            return [self._delta(req) for req in touched if not req.chosen_by_search]
        deltas = []
        for req in touched:
            if req.chosen_by_search:  # a beam (one its search pruned in this loop is skipped)
                search = self._search_of.get(req.request_id)
                if search is not None:
                    deltas += search.on_token(req)
                    if search.done:
                        self._searches.pop(search.request_id, None)
                continue
            if req.request_id not in self._tracked:
                continue  # a sample of a group that failed earlier in this loop
            delta = self._delta(req)
            group = self._group_of.get(req.request_id)
            if group is None:
                deltas.append(delta)
                continue
            if delta.error is not None:  # its samples share the grammar: the request fails whole
                self.abort(group.request_id)
                deltas.append(CompletionDelta(group.request_id, [], "", True, FinishReason.ERROR, error=delta.error))
                continue
            deltas += group.on_delta(delta)
            if delta.finished:
                del self._group_of[req.request_id]
            if group.done:
                del self._groups[group.request_id]
        return deltas

    def _delta(self, req: Request) -> CompletionDelta:
        tracked = self._tracked[req.request_id]
        sent, output_ids = tracked.num_sent_tokens, req.output_ids
        new_tokens = output_ids[sent:]
        new_logprobs = req.output_logprobs[sent:] if req.output_logprobs else []
        prompt_logprobs = req.prompt_logprobs_list() if sent == 0 else None  # (None unless asked for)
        tracked.num_sent_tokens = len(output_ids)
        finished = req.status is RequestStatus.FINISHED
        text = ""
        detok = tracked.detok
        if detok is not None and not finished:
            text = detok.step(new_tokens)  # (every decode step of every request: kept lean)
            if detok.stopped_on is not None:
                self.scheduler.finish(req, FinishReason.STOP, detok.stopped_on)
                finished = True
                detok.flush()
                text += detok.take(final=True)
        elif detok is not None:
            # EOS and stop token ids end the output; their text is not part of it.
            ends_on_token = req.finish_reason is FinishReason.STOP
            detok.push(new_tokens[:-1] if ends_on_token else new_tokens)
            detok.flush()
            text = detok.take(final=True)
            if detok.stopped_on is not None and req.finish_reason is FinishReason.LENGTH:
                # The token that completed a stop string was also the last one allowed: the stop
                # string ended the output (its text is cut), so that is the reason reported.
                req.finish(FinishReason.STOP, detok.stopped_on)
        if finished:
            del self._tracked[req.request_id]
        return CompletionDelta(req.request_id, new_tokens, text, finished, req.finish_reason,
                               req.stop_reason, new_logprobs, num_cached_tokens=req.num_cached_tokens,
                               prompt_logprobs=prompt_logprobs, error=req.error)

    def output_of(self, req: Request, text: str) -> RequestOutput:
        """The finished output of a request with n = 1 (for n > 1: RequestOutput.of_choices)."""
        logprobs = list(req.output_logprobs) if req.params.logprobs is not None else None
        cumulative = sum(lp.logprob for lp in logprobs) if logprobs is not None else None
        only = CompletionOutput(0, list(req.output_ids), text, req.finish_reason, req.stop_reason, logprobs,
                                cumulative)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
            token_ids=only.token_ids, text=text, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, logprobs=logprobs, num_cached_tokens=req.num_cached_tokens,
            outputs=[only],
            encoder_prompt_token_ids=None if req.encoder_ids is None else list(req.encoder_ids),
            prompt_logprobs=req.prompt_logprobs_list(),
        )

    def shutdown(self) -> None:
        self._in_flight = None
        self.executor.shutdown()
