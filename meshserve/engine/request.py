"""A request's life: `Request` (inside one replica: tokens known, tokens computed, status, why it
finished) and `Ticket` (inside the cluster: the one record the coordinator, its pool and the
replica holding the request all point at, from admission to the last delta)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from meshserve.core.beam_params import BeamSearchParams
from meshserve.core.outputs import FinishReason, TokenLogprobs
from meshserve.core.sampling_params import SamplingParams

Sink = asyncio.Queue  # of CompletionDelta | BaseException, read by the request's stream


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; never run, or preempted (its KV freed, recomputed when resumed)
    RUNNING = "running"  # holds KV blocks and is scheduled every step (unless held or awaiting its grammar)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Scheduler-side state. `num_computed_tokens` of `all_token_ids` have their K/V in the cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order: lower = older (FCFS)
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when a step is scheduled (its K/V is being written)
    num_pending_outputs: int = 0  # tokens being drawn by scheduled steps whose results are not applied yet
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, grown in place
    # A beam: its search chooses its tokens, so from each step that samples it until the
    # search has chosen (replace_last_output, a fork, or an abort) it is `held`: not scheduled.
    chosen_by_search: bool = False
    held: bool = False
    # structured_outputs: from entering a replica until its driver rank reports the grammar
    # compiled, the request is given no step (engine/scheduler.py).
    awaiting_grammar: bool = False
    error: Exception | None = None  # why it finished with FinishReason.ERROR
    # On a disaggregated prefill replica: the number of output tokens at which it is detached and
    # handed over (0: never), so never scheduled for more (under overlap scheduling a step planned
    # before the last one is applied would compute one more token, which the detach drops: the
    # decode replica would go on after it).
    hand_over_at: int = 0
    beam: BeamSearchParams | None = None  # set: the request is searched (engine/beam_search.py)
    # The prompt-only root of an n / best_of group: it computes these tokens' K/V, samples
    # nothing, and once they are scheduled the scheduler forks these requests off its blocks.
    fork_into: list[Request] | None = None
    # Encoder-decoder models: the encoder's input (the user's prompt; prompt_ids are then the
    # decoder's start tokens) and, while running, the blocks of its cross-attention K/V.
    encoder_ids: list[int] | None = None
    encoder_blocks: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: index of a prompt token -> its logprobs (the first computed
    # is kept: a preempted request computes its prompt again)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)

    def prompt_logprobs_list(self) -> list[TokenLogprobs | None] | None:
        """Per prompt token (None for the first); None unless the request asked for them."""
        if self.params.prompt_logprobs is None:
            return None
        return [None] + [self.prompt_logprobs.get(i) for i in range(1, len(self.prompt_ids))]

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_ids + self.output_ids

    @property
    def prompt_for_workers(self) -> list[int]:
        """The prompt the workers are told: a group root's is its samples' whole prompt. The root
        computes every token but the last, and the logits at its last position are those of the
        prompt's last token, which prompt_logprobs need (workers/prompt_logprobs.py)."""
        return self.fork_into[0].prompt_ids if self.fork_into else self.prompt_ids

    def append_output(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def replace_last_output(self, token_id: int) -> None:
        """Continue with another last token (one whose K/V no step has computed yet)."""
        self.output_ids[-1] = token_id
        self.all_token_ids[-1] = token_id

    @property
    def runs_whole(self) -> bool:
        """n / best_of > 1 or beam search: one replica runs it from prompt to end (no hand-over)."""
        return self.beam is not None or self.params.num_samples > 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_input_tokens(self) -> int:
        """The tokens the request came with: its prompt, and an encoder-decoder's encoder input."""
        return len(self.prompt_ids) + len(self.encoder_ids or ())

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V no step computes yet, a token still being drawn counted."""
        return self.num_tokens + self.num_pending_outputs - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass(eq=False)
class Ticket:
    """A request admitted by the coordinator: what it is (`request`, whose id is the internal
    one replicas know it by), where its deltas go (`sink`), and where it stands.

    client_id:    the id the client gave; free for reuse as soon as the stream ends
    prefill_only: (disaggregated) run until the first token, then hand over
    holder:       the name of the replica holding it; None while its pool holds it
    cancelled:    aborted, or the client left: a hand-over in flight is dropped
    num_streamed: output tokens its stream has delivered (a migration continues after them)
    migrations:   times it moved to another replica after its replica failed (migration.py)
    """

    client_id: str
    request: Request
    sink: Sink = field(default_factory=asyncio.Queue)
    prefill_only: bool = False
    holder: str | None = None
    cancelled: bool = False
    num_streamed: int = 0
    migrations: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id
