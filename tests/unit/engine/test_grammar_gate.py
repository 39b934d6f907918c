"""A structured-output request takes no step until its grammar is compiled (engine/scheduler.py),
so a slow compile holds back that request alone, and a compile that fails (or passes
grammar_compile_timeout_s) finishes that request alone, leaving the replica serving.

Faults are injected by wrapping the driver's compile (GrammarCompiler._compile, run on its
compile threads in this process: the engine's rank is in-process). The oracle is the same
engine without the fault: greedy tokens of each request run alone, which a request must
reproduce exactly when it shares the engine with the delayed one.
"""

from __future__ import annotations

import itertools
import threading

import pytest

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.errors import ConfigError
from meshserve.workers.grammar import GrammarCompiler

PERSON = StructuredOutputs.json_schema({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False})
BROKEN = StructuredOutputs.regex("(yes|no)")  # compiles; the fault below makes the driver's compile raise
CONSTRAINED = SamplingParams(temperature=0, max_tokens=16, structured_outputs=PERSON)
PLAIN = SamplingParams(temperature=0, max_tokens=12)
PROMPT_C = "An exception is raised when"
PROMPT_P = "The for statement is used to iterate over"
_ids = itertools.count()
MAX_STEPS = 400  # far more than any run below needs: a gate that never opens fails, not hangs


def _engine(**scheduler) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_kv_blocks=64, enable_prefix_caching=False),  # every run computes alike
        scheduler=SchedulerConfig(**scheduler),
        attention=AttentionConfig(backend="TORCH"),
    )
    return EngineCore(config, device="cpu", progress=False)


@pytest.fixture(scope="module")
def engine():
    core = _engine()
    yield core
    core.shutdown()


class Run:
    """Steps an engine and gathers every request's tokens and last delta."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokens: dict[str, list[int]] = {}
        self.last: dict[str, object] = {}

    def add(self, rid: str, prompt: str, params: SamplingParams) -> None:
        self.core.add_request(prompt, params, request_id=rid)
        self.tokens[rid] = []

    def step_until(self, done) -> None:
        for _ in range(MAX_STEPS):
            if done():
                return
            for delta in self.core.step():
                self.tokens[delta.request_id] += delta.token_ids
                if delta.finished:
                    self.last[delta.request_id] = delta
        assert done(), f"not done after {MAX_STEPS} steps: {self.tokens}"

    def finished(self, rid: str) -> bool:
        return rid in self.last


def _alone(core: EngineCore, prompt: str, params: SamplingParams) -> list[int]:
    run = Run(core)
    rid = f"alone-{next(_ids)}"
    run.add(rid, prompt, params)
    run.step_until(lambda: not core.has_unfinished())
    assert run.last[rid].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    return run.tokens[rid]


@pytest.fixture
def held_compile(monkeypatch):
    """Fault injection: every driver compile waits until the test sets the event it yields (60 s
    at most, so a gate that waits for the compile inside the step fails an assertion)."""
    release = threading.Event()
    real = GrammarCompiler._compile

    def held_compile_fault(self, spec):
        release.wait(60)
        return real(self, spec)

    def inject():
        monkeypatch.setattr(GrammarCompiler, "_compile", held_compile_fault)
        return release

    yield inject
    release.set()


def test_a_slow_compile_holds_back_only_its_own_request(engine, held_compile):
    want_c, want_p = _alone(engine, PROMPT_C, CONSTRAINED), _alone(engine, PROMPT_P, PLAIN)
    release = held_compile()
    run = Run(engine)
    run.add("slow", PROMPT_C, CONSTRAINED)
    run.add("plain", PROMPT_P, PLAIN)
    run.step_until(lambda: run.finished("plain"))
    # The plain request ran to its end while the grammar was still compiling...
    assert run.tokens["plain"] == want_p
    assert run.tokens["slow"] == [] and not run.finished("slow")
    assert engine.scheduler.requests["slow"].awaiting_grammar
    release.set()
    run.step_until(lambda: run.finished("slow"))
    # ... and the constrained one then drew exactly what it draws alone.
    assert run.tokens["slow"] == want_c
    assert run.last["slow"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.fixture
def broken_fails(monkeypatch):
    """Fault injection: compiling BROKEN raises on the driver's compile thread; others compile."""
    real = GrammarCompiler._compile

    def failing_compile_fault(self, spec):
        if spec == BROKEN:
            raise RuntimeError("fault injection: this grammar does not compile")
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", failing_compile_fault)


def test_a_failed_compile_finishes_only_its_request_and_the_engine_serves_on(engine, broken_fails):
    want_p, want_c = _alone(engine, PROMPT_P, PLAIN), _alone(engine, PROMPT_C, CONSTRAINED)
    free = engine.kv.pool.num_free_blocks
    run = Run(engine)
    run.add("plain", PROMPT_P, PLAIN)  # running when the bad one comes
    run.step_until(lambda: bool(run.tokens["plain"]))
    run.add("bad", PROMPT_C, SamplingParams(temperature=0, max_tokens=4, structured_outputs=BROKEN))
    run.step_until(lambda: not engine.has_unfinished())
    bad = run.last["bad"]
    assert bad.finish_reason is FinishReason.ERROR and run.tokens["bad"] == []
    assert isinstance(bad.error, ConfigError) and bad.error.field == "structured_outputs"
    assert "fault injection: this grammar does not compile" in str(bad.error)
    assert "response_format" in str(bad.error)
    assert run.tokens["plain"] == want_p
    assert engine.kv.pool.num_free_blocks == free  # nothing leaked
    # The same engine serves the next constrained request as before.
    assert _alone(engine, PROMPT_C, CONSTRAINED) == want_c
    assert engine.kv.pool.num_free_blocks == free


def test_a_compile_past_the_bound_fails_its_request_with_the_setting_named(held_compile):
    core = _engine(grammar_compile_timeout_s=0.2)
    try:
        free = core.kv.pool.num_free_blocks
        held_compile()
        run = Run(core)
        run.add("stuck", PROMPT_C, CONSTRAINED)
        run.add("plain", PROMPT_P, PLAIN)
        run.step_until(lambda: not core.has_unfinished())
        stuck = run.last["stuck"]
        assert stuck.finish_reason is FinishReason.ERROR and run.tokens["stuck"] == []
        assert isinstance(stuck.error, ConfigError) and "grammar_compile_timeout_s=0.2" in str(stuck.error)
        assert run.last["plain"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert core.kv.pool.num_free_blocks == free
    finally:
        core.shutdown()


def test_the_bound_is_checked():
    with pytest.raises(ConfigError, match="grammar_compile_timeout_s"):
        SchedulerConfig(grammar_compile_timeout_s=0)


def test_a_failed_compile_fails_an_n_request_whole(engine, broken_fails):
    """Its samples are forked off the prompt's blocks and each waits for the grammar: the client
    gets one error for the request, and every block (the prompt's shared ones too) comes back."""
    free = engine.kv.pool.num_free_blocks
    run = Run(engine)
    run.add("group", PROMPT_C, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, structured_outputs=BROKEN))
    run.step_until(lambda: not engine.has_unfinished())
    assert set(run.last) == {"group"} and run.tokens["group"] == []
    assert run.last["group"].finish_reason is FinishReason.ERROR and isinstance(run.last["group"].error, ConfigError)
    assert engine.kv.pool.num_free_blocks == free
