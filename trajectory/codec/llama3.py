"""Plain Llama 3 codec: `<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>`.

Owns Llama 3 parsing. The plain template renders only message content (no tool
calls, no reasoning), so sampled text is returned as content: a tool call the
template cannot re-render would be lost on the next turn.
"""

from __future__ import annotations

from trajectory.codec.base import ParsedAssistant
from trajectory.codec.template import TemplateCodec


class Llama3Codec(TemplateCodec):
    """Llama 3 without tools; `<|eom_id|>` also ends a turn."""

    family = "llama3"

    def extra_eot_tokens(self) -> tuple[str, ...]:
        return ("<|eom_id|>",)

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        return ParsedAssistant(content=text, reasoning_content=None)
