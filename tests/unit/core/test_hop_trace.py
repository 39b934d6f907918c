"""core/hop_trace.py: off by default (a mark writes nothing); with MESHSERVE_HOP_TRACE set when a
process starts, every mark is one line "<ns> <pid> <stage>[ <key>...]" on the clock other
processes read, its keys (the requests it is about) one word each."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from meshserve.core import hop_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_off_unless_the_environment_names_a_file():
    assert os.environ.get(hop_trace.ENV) is None
    assert not hop_trace.enabled()
    hop_trace.mark("nothing")  # a no-op, no error
    hop_trace.mark("nothing", "request-1", b"x", 3, None)


def test_marks_of_two_processes_share_one_file_and_this_clock(tmp_path):
    path = tmp_path / "hops.txt"
    code = "from meshserve.core import hop_trace as h; h.mark('a'); h.mark('b.c')"
    env = {**os.environ, hop_trace.ENV: str(path), "PYTHONPATH": ROOT}
    before = time.perf_counter_ns()
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    after = time.perf_counter_ns()
    lines = [line.split(" ") for line in path.read_text().splitlines()]
    assert [stage for _, _, stage in lines] == ["a", "b.c", "a", "b.c"]
    assert len({pid for _, pid, _ in lines}) == 2
    stamps = [int(ns) for ns, _, _ in lines]
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after


def test_keys_follow_the_stage_one_word_each(tmp_path):
    """The keys a reader attributes by: given ones in order, bytes decoded, whitespace (a client's
    id may hold some) taken out so that a key stays one word of its line; None and "" left out."""
    path = tmp_path / "hops.txt"
    code = ("from meshserve.core import hop_trace as h; h.mark('step.end', 'cmpl-1', None, '', 'pub:r 2'); "
            "h.mark('http.asgi', b'bench-7'); h.mark('engine.batch', 12, 'x\\ny')")
    env = {**os.environ, hop_trace.ENV: str(path), "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    lines = [line.split(" ")[2:] for line in path.read_text().splitlines()]
    assert lines == [["step.end", "cmpl-1", "pub:r2"], ["http.asgi", "bench-7"], ["engine.batch", "12", "xy"]]
