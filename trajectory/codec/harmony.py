"""gpt-oss (OpenAI harmony) codec: channels, `<|return|>`/`<|call|>` stops, `thinking`.

Owns what the gpt-oss chat template does unlike the families `TemplateCodec` probes
generically (checked against tests/fast/data/templates/openai-gpt-oss-120b.jinja):

- A turn is one or more harmony messages after the generation prompt `<|start|>assistant`:
  `<|channel|>analysis<|message|>R<|end|>` (reasoning), then either
  `<|start|>assistant<|channel|>final<|message|>C<|return|>` or a tool call
  `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{args}<|call|>`
  (the model may also write `<|channel|>commentary to=functions.NAME <|constrain|>json`).
  The engine stops on `<|return|>` and `<|call|>`; `<|end|>` only closes one message.
- The template renders the last assistant message of a prompt-less render (training
  form) with `<|return|>`, every earlier one with `<|end|>`; it reads reasoning from
  `thinking` (mapped here from `reasoning_content`), renders it for a tool-call turn
  until a final answer follows, never for a final answer in history, and renders one
  tool call per message. So every final answer the model closed with `<|return|>` is
  re-rendered (a history rewrite, kept under APPEND and flagged; TEMPLATE forks).
- A system/developer message renders only as the first message: one appended later is
  refused (the template would drop it silently).

The bridge is the template's own render of the new messages after the previous turn
as history (`<|end|>`/`<|call|>`), verified to extend it; committed ids are never
re-tokenized. Detected from the template's markers (`is_harmony_template`), never from
the model's name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from trajectory.codec.base import (
    BridgeRefusal,
    BridgeResult,
    HistoryPolicy,
    Message,
    ParsedAssistant,
    ParsedToolCall,
    RefusalReason,
    ToolCallParseStatus,
    check_bridge_input,
    extend_committed,
)
from trajectory.codec.parsing import new_call_id
from trajectory.codec.probe import DUMMY_SYSTEM, DUMMY_USER, ProbeResult, is_prefix, render_text
from trajectory.codec.template import TemplateCodec

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
_MARKERS = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
# roles a bridge refuses: the template renders them only as the first message
_FIRST_ONLY = dict.fromkeys(
    ("system", "developer"), "the gpt-oss template renders a system/developer message only as the first message")


def is_harmony_template(tokenizer: Any) -> bool:
    """The template speaks harmony: it names every harmony marker, each is one special
    token of the tokenizer, and its generation prompt is `<|start|>assistant`."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not all(m in template for m in _MARKERS):
        return False
    unk = getattr(tokenizer, "unk_token_id", None)
    for marker in _MARKERS:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1 or ids[0] == unk:
            return False
    try:
        msgs = [DUMMY_SYSTEM, DUMMY_USER]
        gen = render_text(tokenizer, msgs, add_generation_prompt=True)
        plain = render_text(tokenizer, msgs, add_generation_prompt=False)
    except Exception:
        return False
    return gen == plain + START + "assistant"


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as the gpt-oss template reads them: reasoning in `thinking`. A tool-call
    turn with both content and reasoning keeps its content (the template raises on both)."""
    out = []
    for m in messages:
        msg = dict(m)
        reasoning = msg.pop("reasoning_content", None)
        if msg.get("role") == "assistant" and reasoning and "thinking" not in msg:
            if not (msg.get("tool_calls") and msg.get("content")):
                msg["thinking"] = reasoning
        out.append(msg)
    return out


class HarmonyCodec(TemplateCodec):
    """The gpt-oss template's codec (module doc)."""

    family = "harmony"
    extra_stop_tokens = (CALL, "<|endoftext|>")
    # what verify-template plays as reasoning on/off: gpt-oss cannot stop reasoning, so
    # "off" is its lowest effort with no reasoning in the history
    thinking_switch = {"on": {"reasoning_effort": "high"}, "off": {"reasoning_effort": "low"}}

    def __init__(self, tokenizer: Any, probe: ProbeResult | None = None) -> None:
        super().__init__(tokenizer, probe)
        self.return_id, self.call_id, self.end_id = self._ids_of((RETURN, CALL, END))
        # a sampled turn ends on <|return|> or <|call|>; close_turn repairs with <|end|>
        self._closed = frozenset((self.return_id, self.call_id, self.end_id))

    def extra_eot_tokens(self) -> tuple[str, ...]:
        return (CALL,)

    def template_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        return template_messages(messages)

    def _render(self, messages, *, tools, gen: bool, template_kwargs) -> str:
        return super()._render(template_messages(messages), tools=tools, gen=gen, template_kwargs=template_kwargs)

    def thinking(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """gpt-oss always reasons (on the analysis channel, which the parse tells apart)."""
        return True

    def close_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        """`<|end|>` after a turn cut inside a message (length, abort, stop string): what
        the template renders after a message in history; nothing after a closed one."""
        if sampled_ids and sampled_ids[-1] in self._closed:
            return []
        return [self.end_id]

    def bridge(
        self,
        history: Sequence[Message],
        committed_tail: Sequence[int],
        new_messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        policy: HistoryPolicy = HistoryPolicy.APPEND,
        committed: Sequence[int] | None = None,
    ) -> BridgeResult | BridgeRefusal:
        """The template's render of `new_messages` after the previous turn as history.

        TEMPLATE with `committed`: the full re-render must extend every committed id, else
        HISTORY_REWRITE (exact, O(context)). APPEND: O(one turn); `rewrites_history` says
        whether a re-render would change what the model saw (`_rewrites`)."""
        refusal = check_bridge_input(history, committed_tail, new_messages, roles=("user", "tool", "assistant"),
                                     closing_ids=self._closed, refused_roles=_FIRST_ONLY)
        if refusal is not None:
            return refusal
        kw = self._internal_kwargs(template_kwargs)
        new = list(new_messages)
        if policy == HistoryPolicy.TEMPLATE and committed is not None:
            return self._bridge_template(list(history) + new, committed, tools=tools, kw=kw)
        prev = {k: v for k, v in history[-1].items() if k != "reasoning_content"}
        base = [DUMMY_SYSTEM, DUMMY_USER, prev]
        gen = list(self.generation_prompt_ids)
        try:
            h_ids = self._ids(base, tools=tools, gen=True, template_kwargs=kw)
            hn_ids = self._ids(base + new, tools=tools, gen=True, template_kwargs=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        if h_ids[len(h_ids) - len(gen):] != gen:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "history render does not end in the generation prompt")
        h_ids = h_ids[: len(h_ids) - len(gen)]
        if not is_prefix(h_ids, hn_ids) or len(hn_ids) == len(h_ids):
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "render(B) is not a prefix of render(B + new)")
        delta = hn_ids[len(h_ids):]
        rewrites = self._rewrites(history, committed_tail, new, tools=tools, kw=kw)
        if rewrites and policy == HistoryPolicy.TEMPLATE:
            return BridgeRefusal(
                RefusalReason.HISTORY_REWRITE,
                "the template re-renders earlier turns when these messages are appended",
            )
        return BridgeResult(prompt_ids=delta, rewrites_history=rewrites)

    def _bridge_template(self, messages: list[Message], committed: Sequence[int], *, tools: Any,
                         kw: Any) -> BridgeResult | BridgeRefusal:
        """TEMPLATE policy: the full re-render must extend every committed id."""
        try:
            full = self._ids(messages, tools=tools, gen=True, template_kwargs=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        return extend_committed(full, committed)

    def _rewrites(self, history: Sequence[Message], tail: Sequence[int], new: list[Message], *,
                  tools: Any, kw: Any) -> bool:
        """Whether a re-render of history + new changes tokens the model saw (APPEND's
        diagnostic, O(one turn)): a final answer closed with `<|return|>` (history renders
        `<|end|>`), its reasoning (dropped), a tool call sampled unlike the template's form
        (seen within the committed tail), or reasoning of tool-call turns that a final
        answer now follows (the template drops it)."""
        prev = history[-1]
        if tail and tail[-1] == self.return_id:
            return True
        finals = not prev.get("tool_calls") or any(
            m.get("role") == "assistant" and not m.get("tool_calls") for m in new)
        if finals and self._reasoning_since_final(history):
            return True
        window = [DUMMY_SYSTEM, DUMMY_USER, dict(prev)]
        try:
            before = self._render(window, tools=tools, gen=False, template_kwargs=kw)
            after = self._render(window + new, tools=tools, gen=True, template_kwargs=kw)
            canon = self.canonical_assistant_ids(prev, template_kwargs=kw)
        except Exception:  # a diagnostic never fails a turn
            return False
        if not after.startswith(before):
            return True
        k = min(len(tail), len(canon))
        return k > 0 and list(tail[len(tail) - k:]) != canon[len(canon) - k:]

    @staticmethod
    def _reasoning_since_final(history: Sequence[Message]) -> bool:
        """A tool-call turn with reasoning after the last final answer (walks back one
        episode of tool calls, not the whole history)."""
        for m in reversed(history):
            if m.get("role") != "assistant":
                continue
            if not m.get("tool_calls"):
                if m is not history[-1]:
                    return False
                continue
            if m.get("reasoning_content") and not m.get("content"):
                return True
        return False

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        return parse_harmony(text, names)


def _messages(text: str) -> list[tuple[str, str, bool]]:
    """(header, body, closed) of each harmony message of a sampled turn. The first header
    follows the generation prompt (no role); later ones start with the role."""
    out = []
    for i, chunk in enumerate(text.split(START)):
        if i == 0 and not chunk:
            continue
        head, sep, body = chunk.partition(MESSAGE)
        if not sep:
            out.append((head, "", False))
            continue
        closed = False
        for close in (END, RETURN, CALL):
            if body.endswith(close):
                body, closed = body[: -len(close)], True
                break
        out.append((head, body, closed))
    return out


def _header(head: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header, in either order the format allows."""
    recipient = _RECIPIENT.search(head)
    channel = None
    if CHANNEL in head:
        rest = head.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ")
        words = rest.split()
        channel = words[0] if words else None
    return channel, recipient.group(1) if recipient else None


def parse_harmony(text: str, names: frozenset[str]) -> ParsedAssistant:
    """analysis -> reasoning_content, final (and commentary without a recipient) ->
    content, commentary to=functions.NAME -> a tool call with JSON arguments. Total:
    malformed output keeps the raw text as content with a typed status."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ParsedToolCall] = []

    def bad(status: ToolCallParseStatus, detail: str) -> ParsedAssistant:
        return ParsedAssistant(content=text, reasoning_content="\n".join(reasoning) or None,
                               status=status, status_detail=detail)

    msgs = _messages(text)
    for n, (head, body, closed) in enumerate(msgs):
        channel, recipient = _header(head)
        last = n == len(msgs) - 1
        if channel is None or (not closed and not last):
            return bad(ToolCallParseStatus.INVALID_FORMAT, f"harmony message without channel or end: {head[:80]!r}")
        if recipient is None:
            if channel == "analysis":
                reasoning.append(body)
            elif channel in ("final", "commentary"):
                content.append(body)
            else:
                return bad(ToolCallParseStatus.INVALID_FORMAT, f"unknown channel {channel!r}")
            continue
        name = recipient.removeprefix("functions.")
        if not names or recipient == name or name not in names:
            return bad(ToolCallParseStatus.INVALID_FORMAT,
                       f"call to {recipient!r}, not one of the request's tools {sorted(names)}")
        try:
            args = json.loads(body)
        except ValueError as exc:
            return bad(ToolCallParseStatus.INVALID_JSON, f"tool call arguments: {exc}")
        if not isinstance(args, dict):
            return bad(ToolCallParseStatus.INVALID_JSON, "tool call arguments are not a JSON object")
        calls.append(ParsedToolCall(id=new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False)))
    return ParsedAssistant(content="".join(content) or (None if calls else ""),
                           reasoning_content="\n".join(reasoning) or None, tool_calls=calls)
