"""Grammars compiled against the model's vocabulary, and one matcher per constrained request (xgrammar).

Lives on the driver rank, next to the logits (the sampler applies the masks). Compiling takes
a few milliseconds for a typical JSON schema (docs/structured_outputs.md), seconds for some
large schemas and vocabularies, so it runs on worker threads from the moment the request is
announced, and no step waits for it: the runner reports each request's compile as done or
failed in its step outputs, and the scheduler gives a constrained request no step until its
grammar is ready (engine/scheduler.py), so other requests keep stepping meanwhile.
The compiler (its tokenizer table is built once, on the first grammar) caches compiled
grammars, and requests asking for a spec that is compiling share that compile, so the samples
of an n > 1 request and repeated schemas compile once.
A compile past the scheduler's bound cannot be stopped (xgrammar's C++); its thread is written
off and replaced, so such compiles cannot take the compile threads over; MAX_STUCK_COMPILES bounds
how many may run on (GrammarCompiler.release).

A matcher follows the request's output: before each draw it accepts the tokens drawn since
the last one (the runner reads them back, as for penalties), then writes the next token's
bitmask (int32 words, bit t of word t // 32 set when token t is allowed).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshserve.core.structured_outputs import StructuredOutputs, engine_reason, load_xgrammar

log = logging.getLogger("meshserve.workers.grammar")

# From this many rows, a step's masks are filled by xgrammar's batch matcher: C++ threads that
# run without the GIL, so a large batch's fill takes a fraction of its serial time. Half the
# cores at most: on the GPU path the host also plans the next step meanwhile.
BATCH_FILL_MIN_ROWS = 8
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
# Grammars compile on this many threads: one slow schema (seconds, and not interruptible once in
# xgrammar's C++) must not hold up every other request's compile behind it.
COMPILE_THREADS = 2
# A compile the driver gave up on (it passed grammar_compile_timeout_s) keeps its thread until
# xgrammar returns: its thread is written off and a fresh one serves the queue instead, so
# runaway compiles cannot take the compile capacity over. At most this many written-off compiles
# run at once (each holds a core and its memory); beyond that, grammars are refused at once with
# the cause, until one of them ends. (Why threads and not a child process that could be killed:
# docs/structured_outputs.md, measured by bench/grammar_compile_paths.py.)
MAX_STUCK_COMPILES = 8
_batch_matcher = None


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return -(-vocab_size // 32)


class CompileRefused(RuntimeError):
    """A grammar refused without compiling. busy: because the compile capacity is held by
    written-off compiles (the server's state, not the grammar: the request may come back later);
    else because an earlier compile of this very grammar passed its bound and still runs."""

    def __init__(self, reason: str, *, busy: bool) -> None:
        super().__init__(reason)
        self.busy = busy


@dataclass(eq=False)
class CompileJob:
    """One grammar's compile, shared by the requests that ask for the same spec while it is on its way."""

    spec: StructuredOutputs
    future: Future = field(default_factory=Future)  # of xgrammar.CompiledGrammar
    num_waiting: int = 1  # requests that still want it (0: refused, or every one left)
    started_at: float | None = None  # time.monotonic() when a thread took it
    written_off: bool = False  # its last waiting request gave up on it while it ran: its thread is written off
    overdue: bool = False  # ... because that request passed its bound (the same spec is refused until it ends)


@dataclass(frozen=True)
class CompileStats:
    """The compile threads' state, for logs and tests."""

    num_serving: int  # threads taking compiles from the queue
    num_stuck: int  # written-off compiles still running (each holds a thread, a core and its memory)
    num_written_off: int  # compiles written off since start (past their bound, or their requests left)
    num_refused: int  # grammars refused at once (MAX_STUCK_COMPILES reached, or their spec written off overdue)


class GrammarCompiler:
    """Compiles StructuredOutputs for one model (its tokenizer.json, logits width and EOS ids) on
    COMPILE_THREADS threads, started on the first grammar; requests asking for the same spec while
    it compiles share its compile."""

    def __init__(self, model_dir: str | Path, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # the xgrammar compiler's creation
        self._state = threading.Condition()  # the queue, the jobs and the counts below
        self._queue: deque[CompileJob] = deque()
        self._jobs: dict[tuple, CompileJob] = {}  # spec.cache_key -> its compile, until it ends
        self._num_serving = 0
        self._num_stuck = self._num_written_off = self._num_refused = 0
        self._closed = False

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = load_xgrammar()
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def _compile(self, spec: StructuredOutputs):
        return self._get_compiler().compile_grammar(spec.grammar())

    def submit(self, spec: StructuredOutputs) -> CompileJob:
        """The spec's compile, on its way (or refused at once: its future then holds CompileRefused).
        Each call is one waiting request, which `release` ends."""
        with self._state:
            job = self._jobs.get(spec.cache_key)
            if job is not None and not job.overdue:  # (written off as its requests left: its result still comes)
                job.num_waiting += 1
                return job
            if job is not None:
                return self._refuse(spec, "an earlier compile of this same grammar passed grammar_compile_timeout_s "
                                          "and still runs (xgrammar cannot stop it)", busy=False)
            if self._num_stuck >= MAX_STUCK_COMPILES:
                return self._refuse(spec, f"grammar compiles are unavailable: {self._num_stuck} earlier compiles "
                                          f"were given up on (past grammar_compile_timeout_s, or their requests left) "
                                          f"and still run (xgrammar cannot stop them; MAX_STUCK_COMPILES="
                                          f"{MAX_STUCK_COMPILES}); try again later", busy=True)
            job = self._jobs[spec.cache_key] = CompileJob(spec)
            self._queue.append(job)
            while self._num_serving < COMPILE_THREADS and not self._closed:
                self._start_thread()
            self._state.notify()
            return job

    def _refuse(self, spec: StructuredOutputs, reason: str, *, busy: bool) -> CompileJob:
        self._num_refused += 1
        log.warning("grammar refused without compiling: %s", reason)
        job = CompileJob(spec, num_waiting=0)
        job.future.set_exception(CompileRefused(reason, busy=busy))
        return job

    def release(self, job: CompileJob, *, overdue: bool) -> None:
        """One request stops waiting for `job`: it passed its bound (`overdue`) or it left. When
        none waits any more, a queued compile is dropped, and a running one is written off: its
        thread runs it to its end (nothing can stop it), while a fresh thread takes its place in
        serving the queue. (A caller that leaves mid-compile must not keep a compile thread either.)"""
        with self._state:
            if job.num_waiting == 0 or job.future.done():
                return
            job.num_waiting -= 1
            if job.num_waiting:
                return
            if job.future.cancel():  # still queued: it never runs
                self._jobs.pop(job.spec.cache_key, None)
                return
            job.overdue |= overdue
            if not job.written_off:
                job.written_off = True
                self._num_serving -= 1
                self._num_stuck += 1
                self._num_written_off += 1
                log.log(logging.WARNING if overdue else logging.DEBUG,
                        "grammar compile written off after %.1f s, %s (xgrammar cannot stop it: it keeps a thread "
                        "until it ends; %d written-off compiles running, at most %d): %.120s",
                        time.monotonic() - job.started_at, "past its bound" if overdue else "its requests left",
                        self._num_stuck, MAX_STUCK_COMPILES, job.spec.source)
                if self._num_stuck < MAX_STUCK_COMPILES and not self._closed:
                    self._start_thread()

    def _start_thread(self) -> None:
        # Daemon: a compile that never ends must not hold up the process's exit.
        self._num_serving += 1
        threading.Thread(target=self._serve, name="grammar-compile", daemon=True).start()

    def _serve(self) -> None:
        """A compile thread: compiles queued jobs until shutdown, or until a job it ran was written
        off and a fresh thread has taken its place."""
        state = self._state
        while True:
            with state:
                while not self._queue and not self._closed:
                    state.wait()
                if self._closed:
                    self._num_serving -= 1
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue  # dropped while queued
                job.started_at = time.monotonic()
            try:
                compiled = self._compile(job.spec)
            except Exception as exc:
                job.future.set_exception(exc)
            else:
                job.future.set_result(compiled)
            with state:
                if self._jobs.get(job.spec.cache_key) is job:
                    del self._jobs[job.spec.cache_key]
                if not job.written_off:
                    continue
                self._num_stuck -= 1
                log.info("a written-off grammar compile ended after %.1f s (%d still running)",
                         time.monotonic() - job.started_at, self._num_stuck)
                if self._num_serving >= COMPILE_THREADS or self._closed:
                    return  # its replacement serves the queue
                self._num_serving += 1  # none replaced it (MAX_STUCK_COMPILES were running): serve again

    def stats(self) -> CompileStats:
        with self._state:
            return CompileStats(self._num_serving, self._num_stuck, self._num_written_off, self._num_refused)

    def shutdown(self) -> None:
        """Stop the threads (a running compile ends first) and drop the queued compiles."""
        with self._state:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._state.notify_all()


class GrammarState:
    """One request's matcher; `output_ids` is the runner's list of the request's drawn tokens."""

    def __init__(self, compiler: GrammarCompiler, spec: StructuredOutputs, output_ids: list[int]) -> None:
        self._compiler = compiler
        self._job = compiler.submit(spec)
        self._compiled = self._job.future
        self._waits = True  # until released (once): the compiler counts the requests waiting for a job
        self.output_ids = output_ids
        self._matcher = None
        self._num_accepted = 0
        self.failed = False  # a token the grammar refused (a dropped step's token, or ignore_eos past the end)

    @property
    def is_compiling(self) -> bool:
        return not self._compiled.done()

    def compile_error(self) -> str | None:
        """Why the compile failed (a short line for the user); None when it succeeded. Only once
        it is no longer compiling."""
        exc = self._compiled.exception(timeout=0)
        return None if exc is None else engine_reason(exc)

    @property
    def refused_busy(self) -> bool:
        """Whether the grammar was refused for want of compile capacity (CompileRefused busy): the
        server's state, answered as unavailable rather than as a bad grammar. Only once it is no
        longer compiling."""
        exc = self._compiled.exception(timeout=0)
        return isinstance(exc, CompileRefused) and exc.busy

    def stop_waiting(self, *, overdue: bool) -> None:
        """The request no longer waits for its compile: it passed its bound (`overdue`: the compile
        is written off unless another request still waits for it) or it left."""
        if self._waits:
            self._waits = False
            self._compiler.release(self._job, overdue=overdue)

    def _sync(self):
        # The scheduler draws for a request only once the runner reported its grammar compiled,
        # so this result() does not wait.
        if self._matcher is None:
            self._matcher = load_xgrammar().GrammarMatcher(self._compiled.result())
        m, ids = self._matcher, self.output_ids
        while self._num_accepted < len(ids) and not self.failed:
            token = ids[self._num_accepted]
            self._num_accepted += 1
            if m.is_terminated():
                self.failed = True  # only a step the scheduler drops follows the end: nothing to constrain
            elif not m.accept_token(token):
                log.debug("grammar refused token %d after %d tokens", token, self._num_accepted - 1)
                self.failed = True
        return m

    def ready(self):
        """The matcher, caught up with the output, to fill the next mask; None when every token is
        to be allowed: after the end (a step the scheduler drops, as the request is finished) or
        once off the grammar (the row's output is not used)."""
        m = self._sync()
        return None if self.failed or m.is_terminated() else m

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's mask into bitmask[row] (int32 [R, words], on the host)."""
        fill_masks([self], bitmask, [row])


def fill_masks(states: Sequence[GrammarState], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Write each state's next-token mask into its row of bitmask (int32 [R, words], host)."""
    matchers, at = [], []
    for state, row in zip(states, rows):
        m = state.ready()
        if m is None:
            bitmask[row].fill_(-1)
        else:
            matchers.append(m)
            at.append(row)
    if len(matchers) >= BATCH_FILL_MIN_ROWS:
        global _batch_matcher
        if _batch_matcher is None:
            _batch_matcher = load_xgrammar().BatchGrammarMatcher(FILL_THREADS)
        _batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, at)
        return
    for m, row in zip(matchers, at):
        m.fill_next_token_bitmask(bitmask, row)


def wait_for_any(states: Iterable[GrammarState], timeout: float) -> None:
    """Return when one of the states' compiles ends, or after `timeout` seconds."""
    futures = [s._compiled for s in states]
    if futures:
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
