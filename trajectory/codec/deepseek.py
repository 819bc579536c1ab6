"""DeepSeek V3.1 / V3.2 / V4 codec: `<｜Assistant｜>`, `<think>` prefill, two tool-call markups.

Owns what the generic prober cannot do for DeepSeek templates:

- Prefill overlap. The generation prompt prefills the think block (V3.x thinking off:
  `<think></think>`, thinking on: `<think>`; V4 off: `</think>`) while the template
  renders an earlier assistant message with its own opener (V3.2 / V4 drop the
  `<think>` and keep `</think>` once reasoning is not shown). What the model samples
  after the prompt is the render past the longest suffix of the prefill that the
  render repeats (`</think>`); the prompt's prefill stays as the engine saw it.
- History rewrites at the prefill. A re-render of the last turn that no longer starts
  with the prompt's prefill (V3.2 thinking off: every turn; V3.2/V4 thinking on: a
  new user turn drops reasoning; V3.1 thinking on: reasoning is never rendered) is a
  rewrite, as Qwen3's dropped reasoning: APPEND keeps the committed tokens and flags
  it; TEMPLATE (given every committed id) compares them with the full re-render token
  for token and refuses with HISTORY_REWRITE, so the caller forks.
- Parsing: reasoning before `</think>` when thinking is on (the template's switch is
  `thinking`, else `enable_thinking`, default off), then the template's own tool-call
  markup: V3.1 `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`, V3.2 / V4 DSML
  `<｜DSML｜function_calls>` / `<｜DSML｜tool_calls>` with `invoke` and `parameter`
  tags (string="true": the raw text, "false": JSON). Exactly what the template
  renders for history calls, so render(parse(sampled)) == sampled.

Rendering and bridging otherwise stay template-driven (`TemplateCodec`); the
construction self-check of the generic prober (`verify_round_trip`) runs here too.
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
from trajectory.codec.parsing import new_call_id, split_reasoning
from trajectory.codec.probe import (
    DUMMY_SYSTEM,
    DUMMY_USER,
    ProbeResult,
    decode_text,
    encode,
    is_prefix,
)
from trajectory.codec.template import TemplateCodec
from trajectory.errors import CodecError, TemplateNotSupported

EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
USER = "<\uff5cUser\uff5c>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# V3.1 markup
CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
CALL_SEP = "<\uff5ctool\u2581sep\uff5c>"
# V3.2 / V4 markup
DSML = "\uff5cDSML\uff5c"
_INVOKE = re.compile(r'<' + DSML + r'invoke name="([^"\n]+)">\n')
_PARAM = re.compile(r'<' + DSML + r'parameter name="([^"\n]+)" string="(true|false)">')
_PARAM_CLOSE = "</" + DSML + "parameter>\n"
_INVOKE_CLOSE = "</" + DSML + "invoke>\n"


def is_deepseek_template(template: str) -> bool:
    """DeepSeek's turn markers and end-of-sentence token, and one of its call markups."""
    return all(t in template for t in (USER, ASSISTANT, EOS, THINK_CLOSE)) and (
        CALLS_BEGIN in template or DSML in template
    )


def dsml_block(template: str) -> str | None:
    """The DSML block name the template renders history calls in (V3.2
    `function_calls`, V4 `tool_calls`), None when it uses the V3.1 markup."""
    if DSML not in template:
        return None
    for name in ("tool_calls", "function_calls"):
        if f"'{name}>\\n'" in template or f"{name}>\\n" in template:
            return name
    return "function_calls"


class DeepSeekCodec(TemplateCodec):
    """DeepSeek V3.1 / V3.2 / V4 chat templates (see module doc)."""

    family = "deepseek"

    def __init__(self, tokenizer: Any, probe: ProbeResult | None = None) -> None:
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if not is_deepseek_template(template):
            raise TemplateNotSupported("deepseek: the template lacks DeepSeek's turn and call markers")
        super().__init__(tokenizer, probe)
        if decode_text(tokenizer, self.probe.eot_ids) != EOS or self.probe.gap_ids:
            raise TemplateNotSupported(
                f"deepseek: probed end of turn {decode_text(tokenizer, self.probe.eot_ids)!r}, expected {EOS!r}"
            )
        self._block = dsml_block(template)
        from trajectory.codec.generic import verify_round_trip

        for kw in ({}, {"thinking": True}):
            verify_round_trip(self, template_kwargs=kw)

    # -- thinking ----------------------------------------------------------------

    def thinking(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """The template's switch: `thinking`, else `enable_thinking`, else off."""
        kw = template_kwargs or {}
        return bool(kw.get("thinking", kw.get("enable_thinking", False)))

    # -- canonical sampling (prefill overlap) ------------------------------------------

    def canonical_assistant_ids(
        self, message: Message, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """What the model samples after the generation prompt for `message`, through
        its EOT: the render past the prompt, or past the prompt's prefill where the
        render repeats only its end (`<think></think>` prompt, `</think>` render)."""
        kw = self._internal_kwargs(template_kwargs)
        base = [DUMMY_SYSTEM, DUMMY_USER]
        try:
            p_text = self._render(base, tools=None, gen=True, template_kwargs=kw)
            f_text = self._render(base + [message], tools=None, gen=False, template_kwargs=kw)
        except Exception as exc:
            raise CodecError(f"{self.family}: cannot render assistant message: {exc}") from exc
        out = _after_prefill(p_text, f_text)
        if out is None:
            raise CodecError(f"{self.family}: assistant render does not extend the prompt")
        p_ids, f_ids = encode(self.tokenizer, p_text), encode(self.tokenizer, f_text)
        if f_text.startswith(p_text) and is_prefix(p_ids, f_ids):
            ids = f_ids[len(p_ids):]
        else:
            ids = encode(self.tokenizer, out)
        if not ids or ids[-1] not in self.eot_ids:
            raise CodecError(f"{self.family}: assistant render does not end in the EOT")
        return ids

    # -- bridge --------------------------------------------------------------------

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
        """New prompt ids for `new_messages`: the template's render of them after the
        previous turn's end of sentence; never a guess.

        TEMPLATE with `committed`: exact, the full re-render must extend every committed
        id (else HISTORY_REWRITE); the delta is its tail. Otherwise O(one turn): the
        window [query, last assistant] + new is rendered and the delta is what follows
        the assistant's `<｜end▁of▁sentence｜>` (the template may re-render the turn
        itself: V4 drops reasoning on a user turn even in the base `TemplateCodec`
        uses); a re-render of the turn that no longer shows what the model saw is a
        rewrite (flagged under APPEND, refused under TEMPLATE)."""
        roles = ("user", "tool", "system", "assistant") + (("developer",) if self.developer_role else ())
        refusal = check_bridge_input(history, committed_tail, new_messages, roles=roles, closing_ids=self.eot_ids)
        if refusal is not None:
            return refusal
        if policy == HistoryPolicy.TEMPLATE and committed is not None:
            return self._bridge_exact([*history, *new_messages], committed, tools=tools, kw=template_kwargs)
        kw = self._internal_kwargs(template_kwargs)
        window = [DUMMY_SYSTEM, DUMMY_USER, dict(history[-1])]
        new = list(new_messages)
        try:
            head = self._render(window[:-1], tools=tools, gen=False, template_kwargs=kw)
            closed = self._render(window, tools=tools, gen=False, template_kwargs=kw)
            text = self._render(window + new, tools=tools, gen=True, template_kwargs=kw)
            kept = self._prefill_kept(history[-1], text, tools=tools, kw=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        delta = _after_turn(head, closed, text)
        if delta is None:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY,
                                 "the new messages do not render after the previous turn's end of sentence")
        ids = encode(self.tokenizer, delta)
        if not ids or encode(self.tokenizer, text)[-len(ids):] != ids:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "the new messages add no separable tokens")
        rewrites = not (kept and text.startswith(closed))
        if rewrites and policy == HistoryPolicy.TEMPLATE:
            return BridgeRefusal(RefusalReason.HISTORY_REWRITE,
                                 "the template re-renders the last turn (prefill or reasoning) here")
        # a prefill-only rewrite lies in the prompt before the output: no offset to find
        offset = (self._rewrite_offset(window, new, tools=tools, template_kwargs=kw)
                  if not text.startswith(closed) else None)
        return BridgeResult(prompt_ids=ids, rewrites_history=rewrites, rewrite_offset=offset)

    def _prefill_kept(self, last: Message, after: str, *, tools: Any, kw: Any) -> bool:
        """Whether `after` (the re-render of [query, `last`] + new) starts with what the
        model saw: the prompt (prefill included) and its sampled text (the canonical
        ids, with the reasoning first when the template does not render it)."""
        p_text = self._render([DUMMY_SYSTEM, DUMMY_USER], tools=tools, gen=True, template_kwargs=kw)
        sampled = decode_text(self.tokenizer, self.canonical_assistant_ids(last, template_kwargs=kw))
        reasoning = last.get("reasoning_content")
        if (self.thinking(kw) and reasoning and p_text.endswith(THINK_OPEN)
                and not sampled.startswith(str(reasoning))):
            sampled = str(reasoning) + sampled  # the template never renders it (V3.1)
        return after.startswith(p_text + sampled)

    def _bridge_exact(self, messages: list[Message], committed: Sequence[int], *, tools: Any,
                      kw: Any) -> BridgeResult | BridgeRefusal:
        """TEMPLATE: every committed id must be a prefix of the full re-render."""
        try:
            full = self._ids(messages, tools=tools, gen=True, template_kwargs=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        return extend_committed(full, committed)

    # -- parsing ---------------------------------------------------------------------

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        """Reasoning (thinking on: text before `</think>`), then the template's call markup."""
        reasoning, rest = split_reasoning(text, thinking=thinking)
        reasoning = reasoning or None
        if self._block is None:
            return parse_deepseek_v31(rest, reasoning, names)
        return parse_dsml(rest, reasoning, names, self._block)


def _after_prefill(p_text: str, f_text: str) -> str | None:
    """The render's text the model samples after the prompt `p_text` (module doc);
    None when the render is no continuation of the prompt. The prompt may end in a
    think prefill the render repeats only the end of (`<think></think>` -> `</think>`)."""
    if f_text.startswith(p_text):
        return f_text[len(p_text):]
    for prefill in (THINK_OPEN + THINK_CLOSE, THINK_OPEN, THINK_CLOSE):
        head = p_text[: len(p_text) - len(prefill)]
        if p_text.endswith(prefill) and f_text.startswith(head):
            rest = f_text[len(head):]
            kept = THINK_CLOSE if prefill.endswith(THINK_CLOSE) and rest.startswith(THINK_CLOSE) else ""
            return rest[len(kept):] if kept else None
    return None


def _after_turn(head: str, closed: str, text: str) -> str | None:
    """What `text` (the render of query + assistant + new) adds after the assistant's
    end of sentence: `closed` (query + assistant) ends in it, and the text before it
    may differ from `closed` only inside the assistant turn (after `head`, the query);
    None when the new messages change the query (a system message joins the top
    system prompt) or end no differently."""
    if not closed.endswith(EOS) or not text.startswith(head):
        return None
    n = closed.count(EOS)
    pos = 0
    for _ in range(n):
        pos = text.find(EOS, pos)
        if pos == -1:
            return None
        pos += len(EOS)
    return text[pos:] or None


def _bad(text: str, reasoning: str | None, status: ToolCallParseStatus, detail: str) -> ParsedAssistant:
    return ParsedAssistant(content=text, reasoning_content=reasoning, status=status, status_detail=detail)


def _unknown(name: str, names: frozenset[str]) -> str:
    return f"tool call names {name!r}, not one of the request's tools {sorted(names)}"


def parse_deepseek_v31(text: str, reasoning: str | None, names: frozenset[str]) -> ParsedAssistant:
    """V3.1: `content<｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
    <｜tool▁call▁end｜>)+<｜tool▁calls▁end｜>`. Only when the request offered tools
    (`names`), only to those names; malformed markup is a status, never raised."""
    if not names or (CALLS_BEGIN not in text and CALL_BEGIN not in text):
        if names and (CALLS_END in text or CALL_END in text):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "stray tool-call end marker")
        return ParsedAssistant(content=text, reasoning_content=reasoning)
    start = text.find(CALLS_BEGIN)
    if start == -1:
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "tool call outside a calls block")
    pos = start + len(CALLS_BEGIN)
    calls: list[ParsedToolCall] = []
    while not text.startswith(CALLS_END, pos):
        if not text.startswith(CALL_BEGIN, pos):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unclosed tool calls block")
        sep = text.find(CALL_SEP, pos)
        end = text.find(CALL_END, pos)
        if sep == -1 or end == -1 or sep > end:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unbalanced tool call")
        name = text[pos + len(CALL_BEGIN):sep]
        if name not in names:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, _unknown(name, names))
        try:
            args = json.loads(text[sep + len(CALL_SEP):end])
        except ValueError as exc:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, f"tool call: {exc}")
        if not isinstance(args, dict):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, "tool call arguments are not a JSON object")
        calls.append(ParsedToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False)))
        pos = end + len(CALL_END)
    if text[pos + len(CALLS_END):].strip():
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    return ParsedAssistant(content=text[:start] or None, reasoning_content=reasoning, tool_calls=calls)


def parse_dsml(text: str, reasoning: str | None, names: frozenset[str], block: str) -> ParsedAssistant:
    """V3.2 / V4: `content\\n\\n<｜DSML｜BLOCK>\\n(<｜DSML｜invoke name="N">\\n(<｜DSML｜parameter
    name="K" string="true|false">V</｜DSML｜parameter>\\n)*</｜DSML｜invoke>\\n)+</｜DSML｜BLOCK>`
    (V4 renders a call without arguments as one "\\n"). string="false" values are JSON."""
    opener, closer = f"<{DSML}{block}>\n", f"</{DSML}{block}>"
    if not names or opener not in text:
        if names and (closer in text or f"<{DSML}invoke" in text):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, f"malformed <{DSML}{block}> block")
        return ParsedAssistant(content=text, reasoning_content=reasoning)
    start = text.find(opener)
    pos = start + len(opener)
    calls: list[ParsedToolCall] = []
    while not text.startswith(closer, pos):
        m = _INVOKE.match(text, pos)
        if m is None:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unclosed tool calls block")
        name, pos = m.group(1), m.end()
        if name not in names:
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, _unknown(name, names))
        args: dict[str, Any] = {}
        while (p := _PARAM.match(text, pos)) is not None:
            end = text.find(_PARAM_CLOSE, p.end())
            if end == -1:
                return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unclosed parameter")
            raw = text[p.end():end]
            if p.group(2) == "true":
                args[p.group(1)] = raw
            else:
                try:
                    args[p.group(1)] = json.loads(raw)
                except ValueError as exc:
                    return _bad(text, reasoning, ToolCallParseStatus.INVALID_JSON, f"parameter {p.group(1)!r}: {exc}")
            pos = end + len(_PARAM_CLOSE)
        if not args and text.startswith("\n" + _INVOKE_CLOSE, pos):
            pos += 1  # V4: a call without arguments
        if not text.startswith(_INVOKE_CLOSE, pos):
            return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "unclosed invoke")
        pos += len(_INVOKE_CLOSE)
        calls.append(ParsedToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False)))
    if text[pos + len(closer):].strip():
        return _bad(text, reasoning, ToolCallParseStatus.INVALID_FORMAT, "text after tool calls")
    content = text[:start]
    content = content[:-2] if content.endswith("\n\n") else content
    return ParsedAssistant(content=content or None, reasoning_content=reasoning, tool_calls=calls)
