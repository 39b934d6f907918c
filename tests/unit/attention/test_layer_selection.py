"""One backend for every layer of a hybrid model: windowed and full layers, GPT-OSS's sinks.

NOSINKS (a narrow fake, registered by monkeypatch) serves a plain layer but not one with
learned sinks; automatic selection must then pass over it to a backend that serves every
layer, and naming it must fail with the reason and the layer kind.
"""

import pytest

from meshserve.attention import registry
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.spec import AttentionSpec
from meshserve.errors import ConfigError, NoBackendError


def problem(**spec_kwargs) -> AttentionProblem:
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, **spec_kwargs)
    return AttentionProblem(spec=spec, block_size=16, max_model_len=128)


@pytest.fixture
def nosinks_first(monkeypatch):
    backends = {"NOSINKS": "tests.unit.attention.fake_backends:NoSinksBackend", "TORCH": registry.BACKENDS["TORCH"]}
    monkeypatch.setattr(registry, "BACKENDS", backends)
    monkeypatch.setattr(registry, "PRIORITIES", {**registry.PRIORITIES, "cpu": tuple(backends)})


GPT_OSS_LAYERS = [problem(sliding_window=6, has_sinks=True), problem(has_sinks=True)]
GEMMA2_LAYERS = [problem(sliding_window=6, logits_soft_cap=3.0, scale=0.2), problem(logits_soft_cap=3.0, scale=0.2)]


def test_plain_hybrid_layers_take_the_first_backend(nosinks_first):
    assert registry.select_backend_for_layers(GEMMA2_LAYERS).name == "NOSINKS"


def test_a_backend_without_sinks_is_passed_over_for_every_layer(nosinks_first):
    # The first layer alone would not decide it: a plain first layer, then one with sinks.
    mixed = [problem(sliding_window=6), problem(has_sinks=True)]
    assert registry.select_backend(mixed[0]).name == "NOSINKS"
    assert registry.select_backend_for_layers(mixed).name == "TORCH"
    assert registry.select_backend_for_layers(GPT_OSS_LAYERS).name == "TORCH"


def test_naming_a_backend_without_sinks_says_why_per_layer_kind(nosinks_first):
    with pytest.raises(NoBackendError) as err:
        registry.select_backend_for_layers(GPT_OSS_LAYERS, "nosinks")
    text = str(err.value)
    assert "NOSINKS" in text and "sink" in text
    assert "window 6, learned sinks" in text and "full attention, learned sinks" in text


def test_unknown_backend_name_is_a_config_error():
    with pytest.raises(ConfigError, match="attention_backend"):
        registry.select_backend_for_layers(GPT_OSS_LAYERS, "NOPE")
