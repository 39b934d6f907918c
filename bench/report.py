"""Writing a benchmark's own section of a Markdown file (docs/performance.md), leaving the rest alone,
and the plotting module benchmarks draw their PNGs with."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, block: str, begin: str, end: str) -> None:
    """Replace the text from `begin` to `end` in `path` by `block` (which starts with `begin` and
    ends with `end`), or append `block` when the file has no such section yet."""
    text = path.read_text() if path.exists() else "# Performance\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or None (said once) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return None
    return plt


def save_figure(fig, path) -> None:
    """Lay the figure out, write it to `path` (PNG at 120 dpi) and say so."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
