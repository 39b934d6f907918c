"""Compiles that pass grammar_compile_timeout_s cannot take the compile threads over.

xgrammar cannot stop a compile, so a runaway one keeps its thread: the driver writes that thread
off and starts a fresh one (workers/grammar.py). Faults are injected by wrapping the driver's
compile (tests/grammar_faults.py): a compile of a RUNAWAY spec blocks until the test ends, as a
pathological schema would. Before this, two such compiles held both threads and every later
constrained request failed at its own bound. The oracle for the request served afterwards is
jsonschema on its decoded output.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import pytest
from tokenizers import Tokenizer

from meshserve.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig
from meshserve.core.outputs import FinishReason
from meshserve.core.sampling_params import SamplingParams
from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.engine.engine_config import EngineConfig
from meshserve.engine.engine_core import EngineCore
from meshserve.errors import ConfigError, UnavailableError
from meshserve.workers import grammar
from meshserve.workers.grammar import COMPILE_THREADS, GrammarCompiler
from tests.grammar_faults import RUNAWAY, inject_runaways

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
TIMEOUT_S = 0.3
MAX_STEPS = 2000  # a request that never ends fails the test instead of hanging it


@pytest.fixture
def runaway_compiles(monkeypatch):
    faults = inject_runaways(monkeypatch)
    yield faults
    faults.set()


def _engine(timeout_s: float) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(DEMO_MODEL_DIR), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_kv_blocks=64),
        scheduler=SchedulerConfig(grammar_compile_timeout_s=timeout_s),
        attention=AttentionConfig(backend="TORCH"),
    )
    engine = EngineCore(config, device="cpu", progress=False)
    # A first grammar builds the vocabulary table (the bound is short; CI machines are loaded).
    _run(engine, {"warm-up": _constrained(StructuredOutputs.regex("(yes|no)"))})
    return engine


@pytest.fixture
def core():
    engine = _engine(TIMEOUT_S)
    yield engine
    engine.shutdown()


def _compiler(core: EngineCore) -> GrammarCompiler:
    return core.executor.worker.runner.constraints._compiler


def _run(core: EngineCore, requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], dict[str, object]]:
    tokens, last = {rid: [] for rid in requests}, {}
    for rid, params in requests.items():
        core.add_request("Answer in JSON:", params, request_id=rid)
    for _ in range(MAX_STEPS):
        if not core.has_unfinished():
            break
        for delta in core.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                last[delta.request_id] = delta
    assert not core.has_unfinished(), f"not done after {MAX_STEPS} steps: {tokens}"
    return tokens, last


def _constrained(spec: StructuredOutputs, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)


def _compile_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "grammar-compile"]


def test_runaway_compiles_fail_alone_and_the_next_grammar_compiles_on_a_fresh_thread(core, runaway_compiles):
    before = set(_compile_threads())
    _, last = _run(core, {"runaway-0": _constrained(RUNAWAY[0]), "runaway-1": _constrained(RUNAWAY[1])})
    for rid in ("runaway-0", "runaway-1"):
        assert last[rid].finish_reason is FinishReason.ERROR
        assert isinstance(last[rid].error, ConfigError) and last[rid].error.field == "structured_outputs"
        assert f"grammar_compile_timeout_s={TIMEOUT_S:g}" in str(last[rid].error)
    stats = _compiler(core).stats()
    # Both runaways still hold their threads, written off; two fresh ones serve the queue.
    assert (stats.num_stuck, stats.num_written_off, stats.num_serving) == (2, 2, COMPILE_THREADS)
    assert core.executor.call("counters", [{}])[0]["grammar"] == dataclasses.asdict(stats)  # what the replica reads
    assert len(set(_compile_threads()) - before) == 2  # the replacements (the runaways hold the first two)

    # A constrained request after them compiles and follows its schema (with both threads held by
    # the runaways, it used to fail at its own bound).
    tokens, last = _run(core, {"json": _constrained(StructuredOutputs.json_schema(SCHEMA), max_tokens=48)})
    assert last["json"].finish_reason is FinishReason.STOP, last["json"]
    text = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json")).decode(tokens["json"], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)

    # The same runaway schema again is refused at once (it would only take another thread).
    _, last = _run(core, {"again": _constrained(RUNAWAY[0])})
    assert "an earlier compile of this same grammar" in str(last["again"].error)
    assert isinstance(last["again"].error, ConfigError)  # the grammar itself: a 400 naming the field
    assert _compiler(core).stats().num_refused == 1

    # When the runaways end by themselves, their threads leave (their replacements stay).
    runaway_compiles.set()
    _join_until(lambda: _compiler(core).stats().num_stuck == 0)
    assert _compiler(core).stats().num_serving == COMPILE_THREADS


def test_past_max_stuck_compiles_grammars_are_refused_with_the_cause_until_one_ends(core, runaway_compiles,
                                                                                    monkeypatch):
    monkeypatch.setattr(grammar, "MAX_STUCK_COMPILES", 2)
    free = core.kv.pool.num_free_blocks
    _run(core, {"runaway-0": _constrained(RUNAWAY[0]), "runaway-1": _constrained(RUNAWAY[1])})
    # At the cap no thread replaces the last written-off one; grammars are refused at once.
    tokens, last = _run(core, {"refused": _constrained(RUNAWAY[2]),
                               "plain": SamplingParams(temperature=0, max_tokens=4)})
    assert last["refused"].finish_reason is FinishReason.ERROR and tokens["refused"] == []
    assert "MAX_STUCK_COMPILES=2" in str(last["refused"].error)
    # the server's state, not the grammar: unavailable (HTTP 503, gRPC UNAVAILABLE), not a 400
    assert isinstance(last["refused"].error, UnavailableError)
    assert "grammar_compile_timeout_s" in str(last["refused"].error)
    assert last["plain"].finish_reason is FinishReason.LENGTH  # unconstrained requests are untouched
    assert core.kv.pool.num_free_blocks == free
    runaway_compiles.set()
    _join_until(lambda: _compiler(core).stats().num_stuck == 0)
    assert _compiler(core).stats().num_serving == COMPILE_THREADS
    _, last = _run(core, {"json": _constrained(StructuredOutputs.json_schema(SCHEMA), max_tokens=48)})
    assert last["json"].finish_reason is FinishReason.STOP


def test_a_request_that_leaves_mid_compile_frees_its_thread_and_a_retry_gets_the_result(runaway_compiles):
    engine = _engine(60.0)  # no bound passes here: the request leaves
    try:
        engine.add_request("Answer:", _constrained(RUNAWAY[0]), request_id="left")
        # (a plain request keeps the engine stepping, so the driver hears at once that "left" left)
        engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), request_id="plain")
        for _ in range(MAX_STEPS):
            if runaway_compiles.entered.is_set():
                break
            engine.step()
        assert runaway_compiles.entered.is_set()
        engine.abort("left")
        engine.step()  # the plan tells the driver that the request left
        stats = _compiler(engine).stats()
        assert (stats.num_stuck, stats.num_serving) == (1, COMPILE_THREADS)
        # The same spec again joins the compile still running (not refused): its result comes.
        engine.add_request("Answer:", _constrained(RUNAWAY[0], max_tokens=8), request_id="retry")
        engine.step()
        runaway_compiles.set()
        tokens, last = [], None
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished():
                break
            for delta in engine.step():
                if delta.request_id == "retry":
                    tokens += delta.token_ids
                    last = delta if delta.finished else last
        assert last is not None and last.finish_reason is FinishReason.STOP, last
        text = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json")).decode(tokens, skip_special_tokens=True)
        assert re.fullmatch("(stuck|loop)", text), text
        assert _compiler(engine).stats().num_refused == 0
    finally:
        engine.shutdown()


def test_no_compile_thread_outlives_the_engine(runaway_compiles):
    before = set(_compile_threads())
    engine = _engine(TIMEOUT_S)
    _run(engine, {"runaway": _constrained(RUNAWAY[0]), "json": _constrained(StructuredOutputs.json_schema(SCHEMA))})
    ours = set(_compile_threads()) - before
    assert len(ours) == 1 + COMPILE_THREADS  # the written-off one and the two serving
    engine.shutdown()
    runaway_compiles.set()  # the runaway ends by itself at last
    for t in ours:
        t.join(10)
    assert not [t for t in ours if t.is_alive()]


def _join_until(done, timeout_s: float = 10.0) -> None:
    """Wait (on an event, not a sleep loop of the test's own) until done() holds."""
    stop = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if done():
            return
        stop.wait(0.01)
    assert done()
