"""Kimi K2 / K2-Instruct / K2-Thinking codec: `<|im_end|>` turns, section-wrapped
tool calls with `functions.NAME:IDX` ids, `<think>` reasoning (K2-Thinking).

Owns Kimi's parsing, its sampled assistant form and its rewrite detection; rendering and the
bridge delta stay template-driven (template.py).

- Tool calls: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`. The id
  the model samples is returned to the client as the call's id, so the client sends it back
  and the template (which renders `tool_call['id']` and the tool result's `tool_call_id`, as
  the model repository's templates do) renders the tokens the model sampled.
- Templates that compute ids with a mutable list (`ids.append(...)`, llama.cpp's test copies of
  K2-Instruct/K2-Thinking) cannot render an assistant tool call under transformers'
  `ImmutableSandboxedEnvironment`, which `apply_chat_template` uses (and so vLLM and SGLang):
  refused at load with `TemplateNotSupported`, whatever the ids.
- K2-Thinking renders reasoning only for assistant turns after the split assistant (the
  template's "last non-tool-call assistant"; earlier ones get `<think></think>`). What the model
  samples is `<think>R</think>...`, so the sampled form is the template's render with the
  reasoning put back, and a history that renders it without is a rewrite: APPEND keeps the
  committed tokens and flags it, TEMPLATE refuses (the caller forks), as for Qwen3.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
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
)
from trajectory.codec.generic import verify_round_trip
from trajectory.codec.parsing import split_reasoning
from trajectory.codec.probe import (
    DUMMY_SYSTEM,
    DUMMY_USER,
    ProbeResult,
    encode,
    is_prefix,
    render_text,
)
from trajectory.codec.template import TemplateCodec
from trajectory.errors import CodecError, TemplateNotSupported

SECTION_OPEN, SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_OPEN, CALL_ARGS, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = (SECTION_OPEN, CALL_OPEN, "<|im_middle|>", "<|im_assistant|>")
EMPTY_THINK = "<think></think>"
_CALL = re.compile(
    re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_ARGS) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL
)
_ID = re.compile(r"(?:functions\.)?([^\s:<>]+):(\d+)")
_JSON = json.JSONDecoder()


def is_kimi_template(template: str) -> bool:
    """Whether a chat template is Kimi's (its role and tool-call section tokens)."""
    return all(m in template for m in MARKERS)


def kimi_call_id(name: str, index: int) -> str:
    """The id a Kimi model samples for its `index`-th call of the conversation."""
    return f"functions.{name}:{index}"


def _bad(text: str, reasoning: str | None, status: ToolCallParseStatus, detail: str) -> ParsedAssistant:
    return ParsedAssistant(content=text, reasoning_content=reasoning, status=status, status_detail=detail)


def _call(raw_id: str, raw_args: str, names: frozenset[str]) -> ParsedToolCall | tuple[ToolCallParseStatus, str]:
    """One call from its sampled id and argument text, or (status, detail)."""
    m = _ID.fullmatch(raw_id.strip())
    if m is None:
        return ToolCallParseStatus.INVALID_FORMAT, f"tool call id {raw_id.strip()!r} is not functions.NAME:IDX"
    if m.group(1) not in names:
        return (ToolCallParseStatus.INVALID_FORMAT,
                f"tool call names {m.group(1)!r}, not one of the request's tools {sorted(names)}")
    try:
        args, end = _JSON.raw_decode(raw_args.strip())
    except ValueError as exc:
        return ToolCallParseStatus.INVALID_JSON, f"tool call: {exc}"
    if end != len(raw_args.strip()):
        return ToolCallParseStatus.INVALID_JSON, "tool call: text after the JSON object"
    if not isinstance(args, dict):
        return ToolCallParseStatus.INVALID_JSON, "tool call arguments are not a JSON object"
    return ParsedToolCall(id=raw_id.strip(), name=m.group(1), arguments=json.dumps(args, ensure_ascii=False))


def parse_kimi(text: str, reasoning: str | None, names: frozenset[str]) -> ParsedAssistant:
    """Content, then at most one tool-call section; total (bad markup is a status).

    Only when the request offered tools (`names`), and only calls to those names."""
    if not names:
        return ParsedAssistant(content=text, reasoning_content=reasoning)
    if SECTION_OPEN not in text:
        if any(t in text for t in (SECTION_CLOSE, CALL_OPEN, CALL_ARGS, CALL_CLOSE)):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call markup outside a section")
        return ParsedAssistant(content=text, reasoning_content=reasoning)
    before, rest = text.split(SECTION_OPEN, 1)
    if SECTION_CLOSE not in rest:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unclosed tool calls section")
    body, trailing = rest.split(SECTION_CLOSE, 1)
    if trailing.strip() or SECTION_OPEN in body:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    calls: list[ParsedToolCall] = []
    pos = 0
    for m in _CALL.finditer(body):
        if body[pos : m.start()].strip() or CALL_OPEN in m.group(1) or CALL_ARGS in m.group(2):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call markup")
        call = _call(m.group(1), m.group(2), names)
        if isinstance(call, tuple):
            return _bad(text, reasoning, *call)
        calls.append(call)
        pos = m.end()
    if body[pos:].strip() or not calls:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call markup")
    return ParsedAssistant(content=before or None, reasoning_content=reasoning, tool_calls=calls)


class KimiCodec(TemplateCodec):
    """Kimi K2 family (`<|im_assistant|>...<|im_middle|>`, `<|tool_calls_section_begin|>`)."""

    family = "kimi-k2"

    def __init__(self, tokenizer: Any, probe: ProbeResult | None = None) -> None:
        super().__init__(tokenizer, probe)
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if not is_kimi_template(template):
            raise TemplateNotSupported("kimi-k2: the template lacks Kimi's role and tool-call section tokens")
        self._think = "<think>" in template
        self._check_tool_call_renders()
        verify_round_trip(self)

    def tool_call_id(self, name: str, index: int) -> str:
        """Ids as the model samples them (probe data uses them so renders match samples)."""
        return kimi_call_id(name, index)

    def _check_tool_call_renders(self) -> None:
        """Refuse a template that cannot render an assistant tool call, naming why."""
        call = {"id": kimi_call_id("probe_fn", 0), "type": "function",
                "function": {"name": "probe_fn", "arguments": {"x": 1}}}
        msgs: list[Message] = [DUMMY_SYSTEM, DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "r"}]
        try:
            text = render_text(self.tokenizer, msgs, add_generation_prompt=True)
        except Exception as exc:
            raise TemplateNotSupported(
                f"kimi-k2: the template raises on an assistant tool call ({exc}); transformers' "
                "apply_chat_template renders in an ImmutableSandboxedEnvironment (as vLLM and SGLang do), "
                "where a template may not mutate a list (`ids.append`): use the model repository's "
                "template (it renders tool_call['id']), or --template-family generic to serve it without "
                "tool calls") from exc
        if f"{CALL_OPEN}{call['id']}{CALL_ARGS}" not in text:
            raise TemplateNotSupported("kimi-k2: the template does not render a tool call as Kimi samples it")

    # -- the sampled form -----------------------------------------------------------

    def _sampled_text(self, message: Message, kw: Mapping[str, Any] | None) -> str:
        """The text after the generation prompt that a model sampling `message` emits,
        through `<|im_end|>`: the template's render, with reasoning (K2-Thinking renders
        a last plain answer with an empty think block)."""
        base = [DUMMY_SYSTEM, DUMMY_USER]
        try:
            p_text = self._render(base, tools=None, gen=True, template_kwargs=kw)
            f_text = self._render([*base, message], tools=None, gen=False, template_kwargs=kw)
        except Exception as exc:
            raise CodecError(f"{self.family}: cannot render assistant message: {exc}") from exc
        if not f_text.startswith(p_text):
            raise CodecError(f"{self.family}: assistant render does not extend the prompt")
        tail = f_text[len(p_text) :]
        rc = message.get("reasoning_content")
        if self._think and isinstance(rc, str) and rc and tail.startswith(EMPTY_THINK):
            tail = f"<think>{rc}</think>" + tail[len(EMPTY_THINK) :]
        return tail

    def canonical_assistant_ids(
        self, message: Message, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        ids = encode(self.tokenizer, self._sampled_text(message, self._internal_kwargs(template_kwargs)))
        if not ids or ids[-1] not in self.eot_ids:
            raise CodecError(f"{self.family}: assistant render does not end in the EOT")
        return ids

    # -- bridge: Kimi's rewrites ------------------------------------------------------

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
        """The template-driven delta; plus, since K2-Thinking drops reasoning the model
        sampled: TEMPLATE refuses unless the committed ids are a prefix of the full render
        (O(context), that policy's cost), APPEND flags a last turn rendered otherwise than
        sampled (O(one turn))."""
        res = super().bridge(history, committed_tail, new_messages, tools=tools,
                             template_kwargs=template_kwargs, policy=policy, committed=committed)
        if not isinstance(res, BridgeResult) or not self._think:
            return res
        kw = self._internal_kwargs(template_kwargs)
        if policy == HistoryPolicy.TEMPLATE:
            if committed is None:
                return res
            try:
                full = self._ids([*history, *new_messages], tools=tools, gen=True, template_kwargs=kw)
            except Exception as exc:
                return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
            if not is_prefix(committed, full):
                return BridgeRefusal(RefusalReason.HISTORY_REWRITE,
                                     "the template renders the history otherwise than the model sampled it "
                                     "(K2-Thinking drops earlier reasoning)")
            return res
        if res.rewrites_history:
            return res
        rewritten = self._last_turn_rewritten(history, list(new_messages), tools, kw)
        return replace(res, rewrites_history=True) if rewritten else res

    def _last_turn_rewritten(self, history: Sequence[Message], new: list[Message], tools: Any,
                             kw: Mapping[str, Any]) -> bool:
        """Whether the template renders the last assistant turn, with `new` after it, other
        than it was sampled. The window keeps what decides that: a plain assistant answer
        before it (the template splits the history at one) when the history has one."""
        prev = dict(history[-1])
        earlier = next((m for m in history[:-1] if m.get("role") == "assistant" and not m.get("tool_calls")),
                       None)
        head: list[Message] = [DUMMY_SYSTEM, DUMMY_USER]
        if earlier is not None:
            head += [{"role": "assistant", "content": "ok"}, DUMMY_USER]
        try:
            h_text = render_text(self.tokenizer, head, tools=tools, add_generation_prompt=True, template_kwargs=kw)
            hn_text = render_text(self.tokenizer, [*head, prev, *new], tools=tools, add_generation_prompt=True,
                                  template_kwargs=kw)
            sampled = self._sampled_text(prev, kw)
        except Exception:  # a diagnostic never fails a turn
            return False
        return not hn_text.startswith(h_text + sampled)

    # -- parsing -----------------------------------------------------------------------

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        reasoning = None
        if self._think:
            reasoning, text = split_reasoning(text, thinking=thinking)
            reasoning = reasoning or None
        return parse_kimi(text, reasoning, names)
