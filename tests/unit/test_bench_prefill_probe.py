"""bench/prefill_probe.py on CPU with the toy shape: every variant asked for runs, each prompt
takes a step, and the JSON and the plot are written (the GPU run is the measurement)."""

import json

from bench import prefill_probe


def test_probe_runs_each_variant_and_writes_its_results(tmp_path, capsys):
    assert prefill_probe.main(["--device", "cpu", "--tiny", "--attention-backend", "TORCH", "--repeats", "2",
                               "--input-len", "16", "--variants", "default,eager-prefill,sync",
                               "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "prefill_probe.json").read_text())
    assert [r["variant"] for r in rows] == ["default", "eager-prefill", "sync"]
    assert all(r["ttft_min"] > 0 and r["steps"] >= 1 for r in rows)
    assert (tmp_path / "prefill_probe.png").stat().st_size > 0
    assert "| sync |" in capsys.readouterr().out
