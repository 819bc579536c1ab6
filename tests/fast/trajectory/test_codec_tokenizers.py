"""The offline tokenizer factory: loadable, lossless, deterministic, cached."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from session_server.sim.tokenizers import (
    FAMILIES,
    build_tokenizer,
    cached_tokenizer_dir,
    family_spec_tokens,
)
from trajectory.codec import load_codec


@pytest.mark.parametrize("family", FAMILIES)
def test_loadable_lossless_with_specials(load_tokenizer: Any, family: str) -> None:
    tok = load_tokenizer(family)
    text = 'Hi  there\n\n\tünïcode 😀 {"a": true, "n": 12345}\r\n  '
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in family_spec_tokens(family):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert 2000 <= len(tok) <= 4100
    assert load_codec(tok).family == family


def test_deterministic_and_cached(tmp_path: Path, tokenizer_dirs: dict[str, Path]) -> None:
    again = build_tokenizer("qwen3", tmp_path / "again")
    a = json.loads((tokenizer_dirs["qwen3"] / "tokenizer.json").read_text())
    b = json.loads((again / "tokenizer.json").read_text())
    assert a == b
    d1 = cached_tokenizer_dir("glm4moe", tmp_path / "cache")
    d2 = cached_tokenizer_dir("glm4moe", tmp_path / "cache")
    assert d1 == d2 and (d1 / "tokenizer.json").is_file()
    assert load_codec(str(d1)).family == "glm4moe"
