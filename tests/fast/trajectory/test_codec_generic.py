"""Unknown templates: probed and verified, or refused with TemplateNotSupported."""

from __future__ import annotations

from typing import Any

import pytest

from trajectory.codec import GenericCodec, detect_family, load_codec
from trajectory.errors import TemplateNotSupported

CHATML_NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites every earlier turn (numbers them from the end): never append-only.
REWRITING = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ messages|length - loop.index0 }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _with_template(load_tokenizer: Any, template: str) -> Any:
    tok = load_tokenizer("qwen3")
    clone = type(tok).from_pretrained(tok.name_or_path)
    clone.chat_template = template
    return clone


def test_unknown_append_only_template_is_verified(load_tokenizer: Any) -> None:
    tok = _with_template(load_tokenizer, CHATML_NO_TOOLS)
    assert detect_family(tok).family == "generic"
    codec = load_codec(tok)
    assert isinstance(codec, GenericCodec)
    assert tok.decode(list(codec.eot_ids)) == "<|im_end|>"


def test_rewriting_template_is_refused(load_tokenizer: Any) -> None:
    tok = _with_template(load_tokenizer, REWRITING)
    with pytest.raises(TemplateNotSupported):
        load_codec(tok)


def test_forced_family_is_validated(load_tokenizer: Any) -> None:
    with pytest.raises(TemplateNotSupported):
        load_codec(load_tokenizer("llama3"), family="qwen3")
