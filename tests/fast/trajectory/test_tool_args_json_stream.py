"""Tool-call arguments stream as the canonical `json.dumps(..., ensure_ascii=False)`
text of the model's JSON, whatever formatting the model used and however it is chunked:
the concatenation equals the committed dump and every intermediate output is a prefix."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.codec.json_stream import CanonicalJson, JsonStreamError

_CHARS = st.characters(codec=None) | st.integers(0xD800, 0xDFFF).map(chr)  # controls and lone surrogates too
_KEYS = st.text(_CHARS, max_size=6)
_SCALARS = (
    st.none() | st.booleans() | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(_CHARS, max_size=12)
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
                       max_leaves=20)
_OBJECTS = st.dictionaries(_KEYS, _VALUES, max_size=5)


def _ws(rng: random.Random) -> str:
    return "".join(rng.choice(" \t\n\r") for _ in range(rng.choice([0, 0, 0, 1, 2])))


def _string(s: str, rng: random.Random) -> str:
    """A JSON string literal of `s`, each character written one of the valid ways."""
    out = ['"']
    for ch in s:
        forms = [json.dumps(ch, ensure_ascii=True)[1:-1]]
        if ch not in '"\\' and ord(ch) >= 0x20 and not 0xD800 <= ord(ch) <= 0xDFFF:
            forms.append(ch)
        if ch == "/":
            forms.append("\\/")
        if ord(ch) <= 0xFFFF:
            forms.append(f"\\u{ord(ch):04X}")
        out.append(rng.choice(forms))
    return "".join(out) + '"'


def _number(x: float, rng: random.Random) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(x)
    if isinstance(x, int):
        return rng.choice([str(x), "-0"]) if x == 0 else str(x)
    if math.isnan(x) or math.isinf(x):
        return json.dumps(x)
    return rng.choice([repr(x), f"{x:e}", f"{x:E}", f"{x:.17e}"]) if x == x else repr(x)


def _write(v: Any, rng: random.Random) -> str:
    """`v` as JSON in a random valid formatting (whitespace, escapes, number forms)."""
    if isinstance(v, dict):
        parts = [_ws(rng) + _string(k, rng) + _ws(rng) + ":" + _ws(rng) + _write(x, rng) + _ws(rng) for k, x in v.items()]
        return "{" + (",".join(parts) if parts else _ws(rng)) + "}"
    if isinstance(v, list):
        items = [_ws(rng) + _write(x, rng) + _ws(rng) for x in v]
        return "[" + (",".join(items) if items else _ws(rng)) + "]"
    if isinstance(v, str):
        return _string(v, rng)
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    return _number(v, rng)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(obj=_OBJECTS, seed=st.integers(0, 2**32), cuts=st.lists(st.integers(0, 10**6), max_size=40),
       indent=st.sampled_from([None, None, 2, "\t"]))
def test_tool_args_canonical_stream_equals_json_dumps(obj: dict[str, Any], seed: int, cuts: list[int],
                                                          indent: Any) -> None:
    rng = random.Random(seed)
    text = rng.choice([
        lambda: _write(obj, rng),
        lambda: json.dumps(obj, ensure_ascii=True, indent=indent),
        lambda: json.dumps(obj, ensure_ascii=False, indent=indent, separators=(",", ":")),
    ])()
    want = json.dumps(json.loads(text), ensure_ascii=False)
    cj = CanonicalJson()
    got = ""
    for piece in _chunks(text + " trailing", cuts):
        got += cj.feed(piece)
        assert want.startswith(got), (text, got, want)
    assert cj.done and got == want and cj.rest.strip() == "trailing"


@pytest.mark.parametrize("text", [
    '{"a": 1, "a": 2}', '{"k": {"x": [1], "x": 3}}', '{"\\u0061": 1, "a": 2}',
])
def test_tool_args_duplicate_key_stops_the_stream(text: str) -> None:
    cj = CanonicalJson()
    with pytest.raises(JsonStreamError):
        for ch in text:
            cj.feed(ch)


@pytest.mark.parametrize("text", ['{"a": 01}', '{"a": 1.}', '{"a": tru }', '{"a": "\x01"}', '{"a": "\\x"}',
                                  '{"a": 1,}', "{,}", '{"a" 1}', '{"a": [1 2]}', '{"a": "\\u12G4"}'])
def test_tool_args_invalid_json_raises(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    cj = CanonicalJson()
    with pytest.raises(JsonStreamError):
        cj.feed(text)


@pytest.mark.parametrize("text,want", [
    ('{"n": -0, "f": 1e5, "g": 1E-2, "h": -Infinity, "i": NaN, "j": 1e400}',
     '{"n": 0, "f": 100000.0, "g": 0.01, "h": -Infinity, "i": NaN, "j": Infinity}'),
    ('{"s": "\\ud83d\\ude00 \\ud800 \\ud800\\u0041 \\udc00"}', None),
])
def test_tool_args_numbers_and_surrogates(text: str, want: str | None) -> None:
    want = want or json.dumps(json.loads(text), ensure_ascii=False)
    cj = CanonicalJson()
    assert "".join(cj.feed(c) for c in text) == want and cj.done
