"""Fault injection for grammar compiles: runaway compiles that xgrammar could not stop.

`inject_runaways` wraps the driver's compile (GrammarCompiler._compile, run on its threads in
this process): a compile of a RUNAWAY spec blocks until the test releases it (as a pathological
schema would, within a test's time); other specs compile as they would.
"""

from __future__ import annotations

import threading

from meshserve.core.structured_outputs import StructuredOutputs
from meshserve.workers.grammar import GrammarCompiler

RUNAWAY = [StructuredOutputs.regex(f"(stuck|loop){{{i}}}") for i in (1, 2, 3)]


class Runaways:
    """Compiles of RUNAWAY specs block until `release` is set; `entered` is set when one starts."""

    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()

    def set(self) -> None:
        self.release.set()


def inject_runaways(monkeypatch) -> Runaways:
    """Make RUNAWAY compiles block (until the returned Runaways is set; at most 60 s)."""
    faults = Runaways()
    real = GrammarCompiler._compile

    def runaway_compile_fault(self, spec):
        if spec in RUNAWAY:
            faults.entered.set()
            faults.release.wait(60)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", runaway_compile_fault)
    return faults
