"""`meshserve doctor`: every backend runs one real attention step, checked against float64."""

import pytest

from meshserve import cli
from meshserve.attention import registry


def test_doctor_on_cpu_runs_torch_cpu_sdpa_and_triton_and_reports_flashinfer_absent(capsys):
    assert cli.main(["doctor", "--device", "cpu", "--require", "TORCH,TRITON"]) == 0
    lines = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[:-1]}
    assert lines == {"CPU_SDPA": "PASS", "TORCH": "PASS", "TRITON": "PASS", "FLASHINFER": "ABSENT"}


def test_doctor_fails_when_a_required_backend_cannot_run(capsys):
    assert cli.main(["doctor", "--device", "cpu", "--require", "FLASHINFER"]) == 1
    assert "required but not passing: ['FLASHINFER']" in capsys.readouterr().out


def test_doctor_names_an_unknown_required_backend(capsys):
    assert cli.main(["doctor", "--device", "cpu", "--require", "NOPE"]) == 2
    assert "--require" in capsys.readouterr().err


class WrongBackend(registry.load_backend("TORCH")):
    """Attends correctly, then halves the output: the doctor must catch it."""

    name = "WRONG"

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 0.5


@pytest.mark.parametrize("registered", ["tests.unit.test_doctor:WrongBackend"])
def test_doctor_reports_a_backend_with_wrong_output(monkeypatch, capsys, registered):
    monkeypatch.setitem(registry.BACKENDS, "WRONG", registered)
    assert cli.main(["doctor", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("WRONG") and "FAIL" in line for line in out.splitlines())
    assert "failed: ['WRONG']" in out


def test_doctor_passes_in_a_fresh_process_on_a_cpu_machine():
    """As a user runs it: no TRITON_INTERPRET in the environment, no GPU; TRITON runs in the interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CPU-only machine's behaviour")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "meshserve.cli", "doctor"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[:-1]}
    assert lines["TRITON"] == "PASS" and lines["TORCH"] == "PASS"
    assert done.stdout.splitlines()[-1].startswith("doctor: OK")
