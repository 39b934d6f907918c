"""Tiny checkpoints for every supported architecture, written once per test session."""

import pytest

from tests.tiny_models import ARCHS, write_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint directory, the HF model it was saved from)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: (root / name, write_checkpoint(root / name, name)) for name in ARCHS}
