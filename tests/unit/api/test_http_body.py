"""The JSON shape counter of HTTP bodies (api/http/body.py) against json.loads as the oracle:
strings (keys included) and commas outside strings, whatever the chunking and the escapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.exceptions import HTTPException

from meshserve.api.http.body import JsonShapeCounter, ShapeLimits

UNLIMITED = ShapeLimits(max_strings=1 << 40, max_values=1 << 40)
text = st.text(alphabet=st.sampled_from(['a', '"', "\\", ",", "\u00e9", " ", "[", "}"]), max_size=8)
documents = st.recursive(st.none() | st.booleans() | st.integers() | text,
                         lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=4),
                         max_leaves=30)


def _oracle(value) -> tuple[int, int]:
    """(strings, commas between values) of a decoded document."""
    if isinstance(value, str):
        return 1, 0
    if isinstance(value, list):
        parts = [_oracle(v) for v in value]
        return sum(s for s, _ in parts), sum(c for _, c in parts) + max(0, len(value) - 1)
    if isinstance(value, dict):
        parts = [_oracle(v) for v in value.values()]
        return len(value) + sum(s for s, _ in parts), sum(c for _, c in parts) + max(0, len(value) - 1)
    return 0, 0


@settings(max_examples=200, deadline=None)
@given(document=documents, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
       ascii_only=st.booleans())
def test_counts_match_the_decoded_document_whatever_the_chunks(document, cuts, ascii_only):
    raw = json.dumps(document, ensure_ascii=ascii_only).encode()
    counter = JsonShapeCounter(UNLIMITED)
    edges = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    for a, b in zip(edges, edges[1:]):
        counter.feed(raw[a:b])
    assert (counter.quotes // 2, counter.values) == _oracle(document)
    assert not counter.in_string


def test_a_body_past_a_count_is_refused_before_the_end():
    counter = JsonShapeCounter(ShapeLimits(max_strings=100, max_values=10_000))
    chunk = b'"p",' * 30
    with pytest.raises(HTTPException) as info:
        for _ in range(10):
            counter.feed(chunk)
    assert info.value.status_code == 413 and "more than 100 JSON strings" in info.value.detail
    ids = JsonShapeCounter(ShapeLimits(max_strings=100, max_values=1000))
    with pytest.raises(HTTPException, match="more than 1000 JSON values"):
        ids.feed(b'{"prompt": [' + b"1," * 2000)
