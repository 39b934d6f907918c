"""`meshserve serve` runs its loops on asyncio's loop, or with --uvloop on uvloop's
(api/event_loop.py); the oracle is the type of the loop the coroutine finds itself on, and
uvloop's own module."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from meshserve.api import event_loop
from meshserve.api.serve import configs_of
from meshserve.cli import build_parser
from meshserve.errors import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_uvloop_when_asked_for_and_asyncio_otherwise():
    import uvloop

    assert isinstance(uvloop.new_event_loop(), uvloop.Loop)
    assert event_loop.run(_loop_module(), use_uvloop=True) == uvloop.Loop.__module__
    assert event_loop.run(_loop_module(), use_uvloop=False).startswith("asyncio")


def test_the_serve_flag_is_off_by_default_and_refused_without_uvloop(monkeypatch):
    parser = build_parser()
    assert parser.parse_args(["serve"]).uvloop is False
    args = parser.parse_args(["serve", "--uvloop"])
    assert args.uvloop is True
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: its import fails, find_spec finds none
    with pytest.raises(ConfigError, match="uvloop=True is not allowed: off unless uvloop is installed"):
        configs_of(args)
