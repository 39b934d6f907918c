"""bench/e2e.py's CPU smoke run for every shape in its MODELS table (`--device cpu --tiny
--no-baseline`): the tiny random checkpoint is written, loaded and decoded at batch 1 and 4, and
the table is printed with a row per batch and a roofline from that shape's byte count."""

import json

import pytest

from bench import e2e


@pytest.mark.parametrize("model", sorted(e2e.MODELS))
def test_tiny_run_prints_the_table(model, tmp_path, capsys):
    # A bandwidth of 1 MB/s makes the tiny shapes' roofline readable in the table's 2 decimals.
    argv = ["--model", model, "--device", "cpu", "--tiny", "--no-baseline", "--steps", "3", "--bandwidth", "1e-6",
            "--workdir", str(tmp_path), "--out", str(tmp_path / "out")]  # fmt: skip
    assert e2e.main(argv) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index(e2e.BEGIN):printed.index(e2e.END)]
    assert e2e.MODELS[model].tiny_title in table
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [int(r[0]) for r in rows[1:]] == [1, 4]  # after the header row
    assert "`generate`, batch 4, 16 in / 16 out" in table
    results = json.loads((tmp_path / "out" / "e2e.json").read_text())
    assert sorted(results["meshserve"]["steps"]) == ["1", "4"] and results["bandwidth"] == 1e6
    shape = e2e.MODELS[model].tiny
    for r in rows[1:]:
        bs = int(r[0])
        context = results["meshserve"]["steps"][str(bs)]["context"]
        expected_ms = e2e.MODELS[model].step_bytes(shape, 4, bs, context) / 1e6 * 1e3  # float32 weights
        assert float(r[6]) == pytest.approx(expected_ms, abs=0.006)  # roofline ms, printed with 2 decimals
        assert float(r[2]) > 0  # wall ms per step


def test_fp8_run_with_the_fp8_lm_head(tmp_path, capsys, monkeypatch):
    """--quantization fp8 --quantize-lm-head reaches the engine (the head is an Fp8Linear) and the table says so."""
    from meshserve.api.llm import LLM
    from meshserve.workers.quant.layers import Fp8Linear

    heads = []
    real = LLM.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        heads.append(self.core.executor.worker.runner.model.lm_head)

    monkeypatch.setattr(LLM, "__init__", spy)
    argv = ["--device", "cpu", "--tiny", "--no-baseline", "--steps", "2", "--batch-sizes", "1",
            "--throughput-sizes", "1", "--quantization", "fp8", "--quantize-lm-head", "--workdir", str(tmp_path)]
    assert e2e.main(argv) == 0
    assert len(heads) == 1 and isinstance(heads[0], Fp8Linear)
    assert "(quantization fp8, LM head in FP8 too, small_m_gemm auto)" in capsys.readouterr().out
