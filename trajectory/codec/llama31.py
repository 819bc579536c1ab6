"""Llama 3.1 codec with JSON tool calls (`{"name": ..., "parameters": {...}}`).

Owns Llama 3.1 parsing and date pinning. The template stamps today's date
(`strftime_now`) into the system prompt; comparison renders inside `bridge` pin
`date_string` so a date change between renders cannot break verification (the
delta never contains the system block). Only one tool call per assistant turn:
the template raises on more, which `bridge` reports as RENDER_FAILED.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trajectory.codec.base import ParsedAssistant
from trajectory.codec.parsing import parse_llama31
from trajectory.codec.template import TemplateCodec

PINNED_DATE = "26 Jul 2024"


class Llama31Codec(TemplateCodec):
    """Llama 3.1 JSON tools; `<|eom_id|>` also ends a turn."""

    family = "llama3.1"

    def extra_eot_tokens(self) -> tuple[str, ...]:
        return ("<|eom_id|>",)

    def _internal_kwargs(self, template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        kw = dict(template_kwargs or {})
        kw.setdefault("date_string", PINNED_DATE)
        return kw

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        return parse_llama31(text, names)
