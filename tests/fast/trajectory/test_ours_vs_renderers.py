"""The evidence behind keeping our hand-written codecs, checked on every run:
the renderers codec refuses the Llama 3 / 3.1 templates, fails on GLM-4.5's, and for
Qwen3 lacks the rewrite offset ours reports (bench/ours_vs_renderers.py measures cost)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.ours_vs_renderers import PAIRS, contract, sets_rewrite_offset
from trajectory.codec import load_codec
from trajectory.codec.renderers_codec import RenderersCodec
from trajectory.errors import TemplateNotSupported


@pytest.mark.parametrize("family", ["llama3", "llama3.1"])
def test_renderers_refuses_our_llama_templates(load_tokenizer: Any, family: str) -> None:
    with pytest.raises(TemplateNotSupported):
        RenderersCodec(load_tokenizer(family), PAIRS[family])


def test_renderers_glm45_fails_the_contract_ours_passes(load_tokenizer: Any) -> None:
    tok = load_tokenizer("glm4moe")
    assert contract(tok, "glm4moe", load_codec(tok), examples=15)[0] == 2
    passed, _, failure = contract(tok, "glm4moe", RenderersCodec(tok, "glm-4.5"), examples=40)
    assert passed < 2 and failure is not None


def test_qwen3_both_pass_only_ours_reports_the_rewrite_offset(load_tokenizer: Any) -> None:
    tok = load_tokenizer("qwen3")
    ours, theirs = load_codec(tok), RenderersCodec(tok, "qwen3")
    assert contract(tok, "qwen3", ours, examples=10)[0] == 2
    assert contract(tok, "qwen3", theirs, examples=10)[0] == 2
    assert sets_rewrite_offset(ours) and not sets_rewrite_offset(theirs)
