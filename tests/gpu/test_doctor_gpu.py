"""`meshserve doctor` on a GPU: TORCH, TRITON and (when installed) FLASHINFER run a bf16 step."""

import importlib.util

import pytest
import torch

from meshserve import cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["TORCH", "TRITON", "FLASHINFER"])
def test_doctor_passes_on_the_gpu(name, capsys):
    if name == "FLASHINFER" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (the image installs flashinfer-cubin and its JIT cache)")
    code = cli.main(["doctor", "--device", "cuda", "--require", name])
    out = capsys.readouterr().out
    assert code == 0, out
    assert any(line.startswith(name) and " PASS " in line for line in out.splitlines()), out
