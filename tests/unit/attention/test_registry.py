"""Backend selection: automatic, explicit, refusals, import failures, and their messages."""

import pytest

from meshserve.attention import registry
from meshserve.attention.backend import AttentionProblem
from meshserve.attention.backends.torch_ref import TorchBackend
from meshserve.attention.spec import AttentionSpec, KVCacheDtype
from meshserve.errors import ConfigError, NoBackendError


def problem(**spec_kwargs) -> AttentionProblem:
    block_size = spec_kwargs.pop("block_size", 16)
    max_model_len = spec_kwargs.pop("max_model_len", 256)
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, **spec_kwargs)
    return AttentionProblem(spec=spec, block_size=block_size, max_model_len=max_model_len)


@pytest.fixture
def fake_registry(monkeypatch):
    """A CPU priority list of NEEDSPKG > NOSINKS > BROKEN > TORCH."""
    backends = {
        "NEEDSPKG": "tests.unit.attention.fake_backends:NeedsPackageBackend",
        "NOSINKS": "tests.unit.attention.fake_backends:NoSinksBackend",
        "BROKEN": "tests.unit.attention.no_such_module:Backend",
        "TORCH": registry.BACKENDS["TORCH"],
    }
    monkeypatch.setattr(registry, "BACKENDS", backends)
    monkeypatch.setattr(registry, "PRIORITIES", {**registry.PRIORITIES, "cpu": tuple(backends)})
    return backends


def test_automatic_takes_first_valid_in_priority(fake_registry):
    assert registry.select_backend(problem()).name == "NOSINKS"


def test_automatic_skips_backend_without_a_feature(fake_registry):
    assert registry.select_backend(problem(has_sinks=True)).name == "TORCH"
    verdicts = {v.name: v for v in registry.explain(problem(has_sinks=True))}
    assert verdicts["NOSINKS"].reasons == ("learned sink logits not supported",)
    assert verdicts["NEEDSPKG"].reasons[0] == "package 'surely_not_installed_pkg' is not installed"
    assert "cannot be imported" in verdicts["BROKEN"].reasons[0]
    assert verdicts["TORCH"].ok


def test_explicit_selection_validates_and_lists_reasons(fake_registry):
    assert registry.select_backend(problem(), "torch").name == "TORCH"
    with pytest.raises(NoBackendError) as err:
        registry.select_backend(problem(use_alibi=True, block_size=128, max_model_len=256), "NOSINKS")
    text = str(err.value)
    assert "NOSINKS" in text and "ALiBi not supported" in text and "block_size=128 outside [16, 64]" in text


def test_explicit_import_failure_is_a_reason(fake_registry):
    with pytest.raises(NoBackendError, match="BROKEN: cannot be imported"):
        registry.select_backend(problem(), "BROKEN")


def test_unknown_name_lists_valid_names(fake_registry):
    with pytest.raises(ConfigError) as err:
        registry.select_backend(problem(), "FLASH")
    assert err.value.field == "attention_backend"
    assert "['BROKEN', 'NEEDSPKG', 'NOSINKS', 'TORCH']" in str(err.value)


def test_nothing_valid_lists_every_backend_with_reasons(fake_registry):
    bad = problem(kv_cache_dtype=KVCacheDtype.FP8_E4M3, block_size=256, max_model_len=256)
    with pytest.raises(NoBackendError) as err:
        registry.select_backend(bad)
    text = str(err.value)
    for name in fake_registry:
        assert f"  {name}: " in text
    assert "the naive layout does not take an FP8 KV cache" in text


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(block_size=24, max_model_len=240), "block_size=24 is not a power of two"),
        (dict(block_size=32, max_model_len=1000), "max_model_len=1000 is not a multiple of block_size=32"),
        (dict(block_size=512, max_model_len=256), "block_size=512 is larger than max_model_len=256"),
        (dict(block_size=256, max_model_len=256, has_sinks=True), "the naive layout does not take sinks"),
        (dict(block_size=256, max_model_len=256, kv_cache_dtype="fp8_e5m2"),
         "the naive layout does not take an FP8 KV cache"),
    ],
)
def test_layout_rules(kwargs, reason):
    assert reason in TorchBackend.validate_configuration(problem(**kwargs))


def test_naive_and_paged_layouts_are_valid_for_torch():
    assert TorchBackend.validate_configuration(problem(block_size=256, max_model_len=256)) == []
    assert TorchBackend.validate_configuration(problem(block_size=16, max_model_len=256)) == []


def test_device_dtype_and_head_size_reasons(fake_registry):
    from tests.unit.attention.fake_backends import NoSinksBackend

    p = AttentionProblem(spec=AttentionSpec(num_heads=4, num_kv_heads=4, head_size=2000), dtype="float64",
                         device="xpu")
    reasons = NoSinksBackend.validate_configuration(p)
    assert "device 'xpu' not supported (supports ['cpu', 'cuda'])" in reasons
    assert "dtype 'float64' not supported (supports ['bfloat16', 'float16', 'float32'])" in reasons
    assert "head size 2000 not supported (supports 1..1024)" in reasons


def test_platform_lists():
    def on(cc):
        return registry.platform_of(AttentionProblem(spec=problem().spec, device="cuda", compute_capability=cc))

    assert on((9, 0)) == "cuda_sm90"
    assert on((10, 0)) == "cuda_sm100"
    assert on((8, 0)) == "cuda"
    assert registry.platform_of(problem()) == "cpu"


def test_constructing_a_backend_for_an_invalid_problem_fails():
    with pytest.raises(NoBackendError, match="TORCH cannot serve"):
        TorchBackend(problem(block_size=24, max_model_len=240))


def test_config_accepts_exactly_the_registered_backends():
    """config.py validates backend names against core's list (it may not import the registry)."""
    from meshserve.core.attention_options import ATTENTION_BACKENDS

    assert sorted(ATTENTION_BACKENDS) == sorted(registry.BACKENDS)
