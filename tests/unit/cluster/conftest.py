"""Fixtures shared by the cluster tests."""

from __future__ import annotations

import pytest

from tests.tiny_models import write_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random-weight tiny Llama checkpoint with a tokenizer (the one the single-process oracle
    of cases.py also loads), written once per session."""
    path = tmp_path_factory.mktemp("tiny-llama") / "llama"
    write_checkpoint(path, "llama", seed=4)
    return path
