"""`meshserve serve` runs its loops on uvloop where it is installed unless --no-uvloop
(api/event_loop.py); the oracle is the type of the loop the coroutine finds itself on, and
uvloop's own module."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from meshserve.api import event_loop
from meshserve.cli import build_parser


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_uvloop_by_default_and_asyncio_when_turned_off():
    import uvloop

    assert isinstance(uvloop.new_event_loop(), uvloop.Loop)
    assert event_loop.run(_loop_module(), use_uvloop=True) == uvloop.Loop.__module__
    assert event_loop.run(_loop_module(), use_uvloop=False).startswith("asyncio")


def test_the_serve_flag():
    parser = build_parser()
    assert parser.parse_args(["serve"]).uvloop is True
    assert parser.parse_args(["serve", "--no-uvloop"]).uvloop is False
