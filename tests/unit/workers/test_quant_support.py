"""Weight-format support is data: the generated page is current, the CLI and the loader refuse from it."""

from pathlib import Path

import pytest
import torch

from meshserve.cli import main
from meshserve.errors import ConfigError
from meshserve.workers.loader import _check_served
from meshserve.workers.quant.formats import ONLINE_FP8, WeightFormat, WeightQuant
from meshserve.workers.quant.support import SUPPORT, refusals, render_page

PAGE = Path(__file__).resolve().parents[3] / "docs" / "quantization.md"


def test_quantization_page_is_current():
    page = PAGE.read_text()
    assert render_page(page) == page, "docs/quantization.md is stale: run `make docs`"


def test_every_format_has_a_cpu_path_and_fp8_needs_sm89_on_cuda():
    assert {s.format for s in SUPPORT if s.device == "cpu"} == set(WeightFormat)
    assert refusals(WeightFormat.FP8_BLOCK, "cuda", (9, 0), (128, 128)) == []
    assert "compute capability >= 8.9, this GPU has 8.0" in refusals(WeightFormat.FP8_BLOCK, "cuda", (8, 0))[0]
    assert "weight_block_size[1] >= 16, not 8" in refusals(WeightFormat.FP8_BLOCK, "cuda", (9, 0), (128, 8))[0]
    assert "no compute path on mps" in refusals(WeightFormat.MXFP4, "mps")[0]


def test_loader_refuses_before_reading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="quantization='fp8_channel'.*compute capability >= 9.0"):
        _check_served(ONLINE_FP8, torch.device("cuda"))
    _check_served(WeightQuant("fp8", block=(128, 128)), torch.device("cpu"))  # the CPU reference serves it


def test_backends_cli_says_why_a_format_is_refused(capsys):
    assert main(["backends", "--quiet", "--device", "cuda", "--compute-capability", "8.0"]) == 0
    out = capsys.readouterr().out
    assert "fp8_block   refused: fp8_block needs FP8 tensor cores" in out
    assert "mxfp4       valid: dequantized at load" in out
    assert main(["backends", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| fp8_block | cuda | activations quantized per token per block_k" in out
    assert "--small-m-gemm auto or on" in out
    assert "fp8_block   valid: reference" in out
    assert main(["backends", "--quiet", "--compute-capability", "nine"]) == 2
