"""Generated blocks inside hand-written markdown pages (tables built from declared data)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def replace_block(page: str, begin: str, end: str, body: str) -> str:
    """`page` with the text between the markers `begin` and `end` replaced by `body`."""
    if begin not in page or end not in page:
        raise ValueError(f"page lacks the markers {begin} ... {end}")
    head, _, rest = page.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def docs_main(description: str, table: Callable[[], str], render_page: Callable[[str], str]) -> None:
    """The `python -m ...` entry of a generated table: print it, or `--write PAGE` to refresh that page."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", type=Path, help="refresh the generated block of this markdown page")
    args = parser.parse_args()
    if args.write is None:
        print(table())
    else:
        args.write.write_text(render_page(args.write.read_text()))
