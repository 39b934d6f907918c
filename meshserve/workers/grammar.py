"""Grammars compiled against the model's vocabulary, and one matcher per constrained request (xgrammar).

Lives on the driver rank, next to the logits (the sampler applies the masks). Compiling takes
a few milliseconds for a typical JSON schema (docs/structured_outputs.md), seconds for some
large schemas and vocabularies, so it runs on worker threads from the moment the request is
announced, and no step waits for it: the runner reports each request's compile as done or
failed in its step outputs, and the scheduler gives a constrained request no step until its
grammar is ready (engine/scheduler.py), so other requests keep stepping meanwhile.
The compiler (its tokenizer table is built once, on the first grammar) caches compiled
grammars, so the samples of an n > 1 request and repeated schemas compile once.

A matcher follows the request's output: before each draw it accepts the tokens drawn since
the last one (the runner reads them back, as for penalties), then writes the next token's
bitmask (int32 words, bit t of word t // 32 set when token t is allowed).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
_batch_matcher = None


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return -(-vocab_size // 32)


class GrammarCompiler:
    """Compiles StructuredOutputs for one model (its tokenizer.json, logits width and EOS ids)."""

    def __init__(self, model_dir: str | Path, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._compiler = None
        self._lock = threading.Lock()

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

    def submit(self, spec: StructuredOutputs) -> Future:
        """The compiled grammar, on its way (a Future of xgrammar.CompiledGrammar)."""
        return self._pool.submit(self._compile, spec)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher; `output_ids` is the runner's list of the request's drawn tokens."""

    def __init__(self, compiled: Future, output_ids: list[int]) -> None:
        self._compiled = compiled
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
