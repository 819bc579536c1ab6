"""GLM-4 MoE codec: role tokens that double as stop tokens, XML tool arguments.

Owns GLM parsing and documents GLM closing. GLM has no end-of-turn token: the
model stops by sampling the next role token (`<|user|>` after a reply,
`<|observation|>` after tool calls), which is also the first token the template
renders for the next message. So `close_turn` returns [] (there is no EOT to
repair), and `bridge` drops the delta's leading role token when it equals the
last committed (sampled) token; after a turn cut short (no role token sampled)
the bridge keeps it, so the role token is emitted exactly once either way. A
sampled role token the next message does not start with (`<|observation|>`, then
a user message) is a ROLE_MISMATCH refusal: the turn forks (base.py's rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trajectory.codec.base import ParsedAssistant
from trajectory.codec.parsing import parse_glm, split_reasoning
from trajectory.codec.template import TemplateCodec


class Glm4Codec(TemplateCodec):
    """GLM-4 MoE (`[gMASK]<sop>`, `<|user|>`, `<|observation|>`, `<arg_key>`)."""

    family = "glm4moe"

    def thinking(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """GLM's template tests `enable_thinking is defined and not enable_thinking`."""
        kw = template_kwargs or {}
        return "enable_thinking" not in kw or bool(kw["enable_thinking"])

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        reasoning, rest = split_reasoning(text, thinking=thinking)
        if reasoning is not None:
            reasoning = reasoning.strip() or None
        return parse_glm(rest, reasoning, names)
