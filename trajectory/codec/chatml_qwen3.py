"""Qwen3 / ChatML codec: `<|im_start|>`/`<|im_end|>`, `<think>` reasoning, Hermes tool calls.

Owns Qwen3's parsing. Rendering and bridging are template-driven (template.py);
the known Qwen3 quirk (earlier reasoning dropped on a new *user* turn, kept on
*tool* turns) is detected there as a history rewrite.
"""

from __future__ import annotations

from trajectory.codec.base import ParsedAssistant
from trajectory.codec.parsing import parse_hermes, split_reasoning
from trajectory.codec.template import TemplateCodec


class Qwen3Codec(TemplateCodec):
    """ChatML with `<think>` and `<tool_call>{json}</tool_call>`."""

    family = "qwen3"
    extra_stop_tokens = ("<|endoftext|>",)

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        """Reasoning as the template writes it (`<think>\\nR\\n</think>\\n\\n`), then calls."""
        reasoning, rest = split_reasoning(text, thinking=thinking)
        if reasoning is not None:
            reasoning = reasoning.strip("\n") or None
            rest = rest.lstrip("\n")
        return parse_hermes(rest, reasoning, names)
