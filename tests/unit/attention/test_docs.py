"""docs/attention-backends.md is generated from the registry; stale docs fail here."""

from pathlib import Path

from meshserve.attention.docs import render_page
from meshserve.cli import main

PAGE = Path(__file__).resolve().parents[3] / "docs" / "attention-backends.md"


def test_backend_page_is_current():
    page = PAGE.read_text()
    assert render_page(page) == page, "docs/attention-backends.md is stale: run `make docs`"


def test_cli_prints_table_and_selection(capsys):
    assert main(["backends", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "| feature | TORCH" in out and "Selected: " in out


def test_cli_explains_refusal(capsys):
    assert main(["backends", "--quiet", "--attention-backend", "TORCH", "--block-size", "24"]) == 2
    err = capsys.readouterr().err
    assert "block_size=24 is not a power of two" in err


def _selected(capsys, *flags: str) -> str:
    assert main(["backends", "--quiet", "--head-size", "128", *flags]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Selected"))


def test_cli_says_whether_fresh_prompts_read_the_steps_kv(capsys):
    """On by default from sm_90 (TRITON's fresh tiles, FLASHINFER's ragged wrapper where it is installed);
    below, off with the reason."""
    hopper = _selected(capsys, "--device", "cuda", "--compute-capability", "9.0")
    assert "fresh prompts from the step's K/V: on" in hopper
    ampere = _selected(capsys, "--device", "cuda", "--compute-capability", "8.0")
    assert "fresh prompts from the step's K/V: off (" in ampere
    if "Selected: TRITON" in ampere:  # FLASHINFER where it is installed: off below sm_90 too
        assert "no fresh-prefill tiles for this problem" in ampere
