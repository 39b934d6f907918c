"""Generated blocks inside hand-written markdown pages (tables built from declared data)."""

from __future__ import annotations


def replace_block(page: str, begin: str, end: str, body: str) -> str:
    """`page` with the text between the markers `begin` and `end` replaced by `body`."""
    if begin not in page or end not in page:
        raise ValueError(f"page lacks the markers {begin} ... {end}")
    head, _, rest = page.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"
