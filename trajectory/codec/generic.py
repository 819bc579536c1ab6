"""Codec for an unknown chat template: probe it, verify it, or refuse.

Owns the self-check that makes an unrecognised template usable: after probing,
a short conversation is played turn by turn (canonical sampling, close_turn,
bridge) and must equal the template's own full render; otherwise the template
is refused with `TemplateNotSupported`. Parsing is conservative: reasoning, Hermes
tool calls and XML (`<function=...>`) calls only when the template itself mentions
their markers.
"""

from __future__ import annotations

from typing import Any

from trajectory.codec.base import BridgeResult, ParsedAssistant
from trajectory.codec.parsing import parse_hermes, parse_xml_calls, split_reasoning
from trajectory.codec.probe import DUMMY_SYSTEM, encode, render_text
from trajectory.codec.template import TemplateCodec
from trajectory.errors import CodecError, TemplateNotSupported


class GenericCodec(TemplateCodec):
    """Template-driven codec for templates the registry does not know."""

    family = "generic"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        template = str(getattr(tokenizer, "chat_template", "") or "")
        # what the template's own markers say the model writes (public: the family
        # registry picks the incremental parser from them, `families.incremental_parser`)
        self.reasoning_markers = "</think>" in template
        self.hermes_calls = "<tool_call>" in template
        # Qwen3-Coder's XML calls inside <tool_call> (its renderer refuses the template)
        self.xml_calls = self.hermes_calls and "<function=" in template and "<parameter=" in template
        verify_round_trip(self)

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        reasoning = None
        if self.reasoning_markers:
            reasoning, text = split_reasoning(text, thinking=thinking)
            if reasoning is not None:
                reasoning = reasoning.strip("\n") or None
                text = text.lstrip("\n")
        if self.xml_calls:
            return parse_xml_calls(text, reasoning, names)
        if self.hermes_calls:
            return parse_hermes(text, reasoning, names)
        return ParsedAssistant(content=text, reasoning_content=reasoning)


def verify_round_trip(codec: TemplateCodec, *, template_kwargs: dict[str, Any] | None = None) -> None:
    """Play user/assistant/user incrementally; it must equal the full render at every
    step the bridge calls append-only (a detected rewrite continues as a fork).
    `template_kwargs`: played with them (a family codec checks each thinking mode)."""
    kw = template_kwargs or None
    tok = codec.tokenizer
    msgs: list[dict[str, Any]] = [
        DUMMY_SYSTEM,
        {"role": "user", "content": "What is two plus two?"},
    ]
    try:
        ids = codec.render_first(msgs, template_kwargs=kw)
        for reply, follow in (("It is four.", "And three plus three?"), ("It is six.", None)):
            asst = {"role": "assistant", "content": reply}
            sampled = codec.canonical_assistant_ids(asst, template_kwargs=kw)
            ids += sampled + codec.close_turn(sampled)
            msgs.append(asst)
            if follow is None:
                break
            new = [{"role": "user", "content": follow}]
            res = codec.bridge(msgs, ids[-8:], new, template_kwargs=kw)
            if not isinstance(res, BridgeResult):
                raise TemplateNotSupported(f"bridge refused a plain user turn: {res.detail}")
            ids += res.prompt_ids
            msgs += new
            full = encode(tok, render_text(tok, msgs, add_generation_prompt=True, template_kwargs=kw))
            if res.rewrites_history:
                ids = full  # detected rewrite: continue as a fork from the re-render
            elif full != ids:
                raise TemplateNotSupported("incremental tokens differ from the full render")
    except CodecError as exc:
        if isinstance(exc, TemplateNotSupported):
            raise
        raise TemplateNotSupported(str(exc)) from exc
