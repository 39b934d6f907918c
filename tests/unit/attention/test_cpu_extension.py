"""meshserve's compiled CPU module: where it is built, what its name is keyed by, and what serves
when it cannot be built (the torch ops, after one warning)."""

import logging
from pathlib import Path

import pytest
import torch

from meshserve.attention.backend import KVCache
from meshserve.attention.backends import cpu_extension, cpu_paged_decode, cpu_step_ops
from meshserve.workers.models import fused_ops


@pytest.fixture
def fresh_build_state():
    """cpu_extension() remembers its outcome per process: forget it around the test."""
    cpu_extension.cpu_extension.cache_clear()
    yield
    cpu_extension.cpu_extension.cache_clear()


def test_a_failed_build_logs_one_warning_and_every_op_falls_back(monkeypatch, caplog, fresh_build_state):
    import torch.utils.cpp_extension as ext

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'x': g++ not found")

    monkeypatch.setattr(ext, "load_inline", broken)
    with caplog.at_level(logging.WARNING, logger="meshserve.attention"):
        assert cpu_paged_decode.paged_decode_op() is None
        assert cpu_step_ops.step_ops() is None  # asked again: no second attempt, no second warning
    warnings = [r for r in caplog.records if "CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "g++ not found" in warnings[0].getMessage()
    # the model's fused ops run their torch ops, bit for bit
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    out, total = fused_ops.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_total = fused_ops.add_rms_norm(x, res, w, 1e-6, use_triton=False)
    assert torch.equal(out, ref_out) and torch.equal(total, ref_total)
    cache = KVCache(torch.zeros(2, 2, 4, 1, 8))
    assert not fused_ops.fuses_rotary_write(torch.randn(3, 32), cache)


def test_turned_off_by_the_environment(monkeypatch, fresh_build_state):
    monkeypatch.setenv("MESHSERVE_CPU_KERNELS", "0")
    assert cpu_extension.cpu_extension() is None
    assert cpu_paged_decode.paged_decode_op() is None


def test_built_outside_the_source_tree():
    if cpu_extension.cpu_extension() is None:
        pytest.skip("the CPU module could not be built here (see the logged warning)")
    repo = Path(cpu_extension.__file__).resolve().parents[3]
    build = cpu_extension.cache_dir() / cpu_extension.build_name()
    assert not build.resolve().is_relative_to(repo)
    assert any(build.glob("*.so"))


def test_the_build_is_keyed_by_the_cpu_and_the_sources(monkeypatch):
    """-march=native code is only loaded on the CPU (model and flags) it was built for, and a
    changed source of either part builds anew."""
    monkeypatch.setattr(cpu_extension, "_cpu_model", lambda: "model name: X\nflags: avx2")
    avx2 = cpu_extension.build_name()
    monkeypatch.setattr(cpu_extension, "_cpu_model", lambda: "model name: X\nflags: avx2 avx512f")
    avx512 = cpu_extension.build_name()
    assert avx512 != avx2
    sources = cpu_extension._sources()
    monkeypatch.setattr(cpu_extension, "_sources", lambda: [sources[0], sources[1] + "\n// changed\n"])
    assert cpu_extension.build_name() != avx512
