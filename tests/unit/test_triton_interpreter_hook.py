"""tests/triton_interpreter.py: with the hook, a kernel whose programs call @triton.jit helpers
(two levels deep, as our attention kernels do) patches the language once per launch instead of
once per helper call, and computes exactly what the interpreter as Triton ships it computes
(and what float64 torch computes)."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the hook serves the interpreter")

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from tests.triton_interpreter import skip_repeated_patching, without_the_hook

    @triton.jit
    def _scaled_exp(x, row_max, scale):
        return tl.exp((x - row_max) * scale)

    @triton.jit
    def _softmax_row(x, scale):
        e = _scaled_exp(x, tl.max(x, axis=0), scale)
        return e / tl.sum(e, axis=0)

    @triton.jit
    def _softmax_kernel(x_ptr, out_ptr, n_cols, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf"))
        tl.store(out_ptr + row * n_cols + cols, _softmax_row(x, scale), mask=mask)


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _softmax_kernel[(x.shape[0],)](x, out, x.shape[1], 0.7, BLOCK=16)
    return out


def _count_patches(monkeypatch) -> list[int]:
    """Counts the interpreter's walks over language modules (each _patch_lang makes four or five)."""
    calls = [0]
    original = interpreter._patch_builtin

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    return calls


def test_the_hook_patches_per_launch_not_per_program_and_computes_the_same(monkeypatch):
    assert skip_repeated_patching(), "this Triton's interpreter lacks the internals the hook expects"
    gen = torch.Generator().manual_seed(0)
    small, large = torch.randn(2, 13, generator=gen) * 4, torch.randn(6, 13, generator=gen) * 4
    calls = _count_patches(monkeypatch)
    walks = {}
    for name, x in (("small", small), ("large", large)):
        with without_the_hook():
            calls[0] = 0
            shipped = _run(x)
            walks["shipped", name] = calls[0]
        calls[0] = 0
        hooked = _run(x)
        walks["hooked", name] = calls[0]
        assert torch.equal(hooked, shipped)
        torch.testing.assert_close(hooked.double(), torch.softmax(x.double() * 0.7, dim=1), rtol=1e-6, atol=1e-7)
    # Shipped, every program re-patches for each helper it calls; hooked, a launch patches the
    # modules its kernel and helpers see once, whatever the number of programs.
    assert walks["hooked", "small"] == walks["hooked", "large"], walks
    assert walks["shipped", "large"] > walks["shipped", "small"] > walks["hooked", "small"], walks
