"""`--model org/name` through huggingface_hub's cache, offline, with a cache layout built here.

The layout is the one huggingface_hub writes (models--org--name/{refs,snapshots,blobs}); the
resolver must find the snapshot a branch, a tag or a commit names, refuse what the cache does
not hold with a message naming HF_HUB_OFFLINE, and leave local folders alone.
"""

from __future__ import annotations

import pytest

from meshserve.api.hub import resolve_model
from meshserve.demo_model import DEMO_MODEL_DIR
from meshserve.errors import ConfigError
from tests.hub_cache import MAIN, OLD, hub_cache


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_an_id_resolves_to_its_snapshot(tmp_path, offline):
    folder = hub_cache(tmp_path)
    assert resolve_model("acme/pydoc-llama", cache_dir=tmp_path) == str(folder / "snapshots" / MAIN)
    assert resolve_model("acme/pydoc-llama", revision="old", cache_dir=tmp_path) == str(folder / "snapshots" / OLD)
    assert resolve_model("acme/pydoc-llama", revision="v1", cache_dir=tmp_path) == str(folder / "snapshots" / MAIN)
    assert resolve_model("acme/pydoc-llama", revision=OLD, cache_dir=tmp_path) == str(folder / "snapshots" / OLD)


def test_what_the_cache_lacks_is_refused_naming_offline(tmp_path, offline):
    hub_cache(tmp_path)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set and the hub cache has no snapshot") as info:
        resolve_model("acme/other-model", cache_dir=tmp_path)
    assert info.value.field == "model"
    with pytest.raises(ConfigError) as info:
        resolve_model("acme/pydoc-llama", revision="no-such-branch", cache_dir=tmp_path)
    assert info.value.field in ("model", "revision") and "no-such-branch" in str(info.value)


def test_folders_win_and_non_ids_are_refused(tmp_path, offline, monkeypatch):
    assert resolve_model(DEMO_MODEL_DIR) == str(DEMO_MODEL_DIR)
    local = tmp_path / "acme" / "pydoc-llama"  # a relative folder spelled like an id
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/pydoc-llama") == "acme/pydoc-llama"
    with pytest.raises(ConfigError, match="revision"):
        resolve_model(DEMO_MODEL_DIR, revision="main")
    for bad in ("/no/such/model", "a/b/c", "../x/y", "name-only"):
        with pytest.raises(ConfigError, match="an existing checkpoint directory or a Hugging Face model id"):
            resolve_model(bad)
