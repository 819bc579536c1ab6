"""Gemma 4 codec: `<|turn>role\\n ... <turn|>` turns, a tool loop that stays inside the
model turn, `<|channel>thought` reasoning and `call:NAME{k:v}` tool calls.

Owns what the generic template codec cannot derive for Gemma 4 (all read from the
tokenizer's own template at construction, nothing from the model's name):

- **The generation prompt is not the history's turn header.** With thinking off
  (the default: the template tests `enable_thinking is defined and enable_thinking`)
  the 26B/31B template prefills an empty thought channel,
  `<|turn>model\\n<|channel>thought\\n<channel|>`, and renders history turns with
  `<|turn>model\\n` only. What the model samples is the message body after that
  prompt; a re-render drops the prefill, so every later step rewrites the turn's
  prompt tokens: APPEND keeps them (flagged per turn), TEMPLATE forks.
  With thinking on the header is the whole prompt and the tool loop is append-only.
- **Two stops.** A reply ends with `<turn|>` (then a template `\\n` gap). A message
  with tool calls ends with the token the template renders after its last
  `<tool_call|>` when no result follows yet: `<|tool_response>` (the model samples it
  to hand over to the runtime). Tool results are rendered *inside* that assistant
  turn (`response:NAME{value:...}<tool_response|>`) and no generation prompt
  follows: the model continues the same turn. `close_turn` repairs a turn cut
  after `<tool_call|>` with the tool stop, any other with `<turn|>`.
- **Reasoning** is rendered (`<|channel>thought\\nR\\n<channel|>`, the wrapper read
  from the template) only for tool-call messages after the last user message; a
  thinking model also emits it before a plain answer, which history drops (a
  rewrite, like Qwen3). **Content** of a tool-call message is rendered after the
  tool results; the bridge leaves it out of its base (the model sampled it before
  the stop), and the rewrite is flagged.
- **Tool-call arguments** use the template's own syntax: unquoted keys, strings in
  `<|"|>`, `true`/`false`, numbers as Python prints them, and `None` for JSON null
  (the template's `{{ argument }}` of a Python None). `parse_call_arguments` reads
  it back exactly (typed failures, never an exception).
"""

from __future__ import annotations

import json
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

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TURN_CLOSE = "<turn|>"
QUOTE = '<|"|>'
_MARK = "Zq7gemma"
_PROBE_CALL = {"id": "call_0probe", "type": "function", "function": {"name": "probe_fn", "arguments": {"x": 1}}}


class ArgumentError(ValueError):
    """Gemma 4 argument text that is not the template's syntax."""


class _Args:
    """Recursive reader of the template's `format_argument` output (see module doc)."""

    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def value(self) -> Any:
        t = self.text
        if t.startswith(QUOTE, self.i):
            end = t.find(QUOTE, self.i + len(QUOTE))
            if end < 0:
                raise ArgumentError("unclosed <|\"|> string")
            out = t[self.i + len(QUOTE) : end]
            self.i = end + len(QUOTE)
            return out
        if self.i >= len(t):
            raise ArgumentError("missing value")
        if t[self.i] == "{":
            return self.obj()
        if t[self.i] == "[":
            return self.array()
        return self.literal()

    def literal(self) -> Any:
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in ",}]":
            self.i += 1
        raw = self.text[start : self.i]
        if raw in ("true", "false"):
            return raw == "true"
        if raw in ("None", "null"):
            return None
        try:
            out = json.loads(raw)
        except ValueError:
            raise ArgumentError(f"bare value {raw[:40]!r} is not a number, boolean or null") from None
        if not isinstance(out, (int, float)) or isinstance(out, bool):
            raise ArgumentError(f"bare value {raw[:40]!r} is not a number")
        return out

    def key(self) -> str:
        if self.text.startswith(QUOTE, self.i):
            out = self.value()
            assert isinstance(out, str)
            return out
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in ":,{}[]":
            self.i += 1
        key = self.text[start : self.i]
        if not key or QUOTE in key:
            raise ArgumentError("missing object key")
        return key

    def obj(self) -> dict[str, Any]:
        self.i += 1
        out: dict[str, Any] = {}
        if self.text.startswith("}", self.i):
            self.i += 1
            return out
        while True:
            k = self.key()
            if not self.text.startswith(":", self.i):
                raise ArgumentError(f"missing ':' after key {k[:40]!r}")
            self.i += 1
            out[k] = self.value()
            if self.text.startswith("}", self.i):
                self.i += 1
                return out
            if not self.text.startswith(",", self.i):
                raise ArgumentError("expected ',' or '}' in an object")
            self.i += 1

    def array(self) -> list[Any]:
        self.i += 1
        out: list[Any] = []
        if self.text.startswith("]", self.i):
            self.i += 1
            return out
        while True:
            out.append(self.value())
            if self.text.startswith("]", self.i):
                self.i += 1
                return out
            if not self.text.startswith(",", self.i):
                raise ArgumentError("expected ',' or ']' in an array")
            self.i += 1


def parse_call_arguments(text: str) -> dict[str, Any]:
    """`{k:v,...}` as the template renders a call's arguments, back to a dict; raises
    `ArgumentError` on anything else (trailing text included)."""
    if not text.startswith("{"):
        raise ArgumentError("arguments must start with '{'")
    reader = _Args(text)
    out = reader.obj()
    if reader.i != len(text):
        raise ArgumentError("text after the arguments object")
    return out


def parse_gemma4_calls(text: str, reasoning: str | None, names: frozenset[str]) -> ParsedAssistant:
    """Content and `<|tool_call>call:NAME{...}<tool_call|>` calls (only when the request
    offered tools, only to their names); content is the text outside the calls, in
    order (the template renders it after them). Malformed markup: a typed status and
    the text as content."""

    def bad(status: ToolCallParseStatus, detail: str) -> ParsedAssistant:
        return ParsedAssistant(content=text, reasoning_content=reasoning, status=status, status_detail=detail)

    if not names:
        return ParsedAssistant(content=text, reasoning_content=reasoning)
    pieces: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(CALL_OPEN, pos)
        stray = text.find(CALL_CLOSE, pos)
        if start < 0:
            if stray >= 0:
                return bad(ToolCallParseStatus.INVALID_FORMAT, f"stray {CALL_CLOSE}")
            pieces.append(text[pos:])
            break
        if 0 <= stray < start:
            return bad(ToolCallParseStatus.INVALID_FORMAT, f"stray {CALL_CLOSE}")
        pieces.append(text[pos:start])
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            return bad(ToolCallParseStatus.INVALID_FORMAT, f"unclosed {CALL_OPEN}")
        body = text[start + len(CALL_OPEN) : end]
        if CALL_OPEN in body:
            return bad(ToolCallParseStatus.INVALID_FORMAT, f"nested {CALL_OPEN}")
        head, brace, rest = body.partition("{")
        name = head.removeprefix("call:")
        if not head.startswith("call:") or not brace or not name or any(c.isspace() for c in name):
            return bad(ToolCallParseStatus.INVALID_FORMAT, f"tool call is not call:NAME{{...}}: {body[:80]!r}")
        if name not in names:
            return bad(ToolCallParseStatus.INVALID_FORMAT,
                       f"tool call names {name!r}, not one of the request's tools {sorted(names)}")
        try:
            args = parse_call_arguments("{" + rest)
        except ArgumentError as exc:
            return bad(ToolCallParseStatus.INVALID_JSON, f"tool call {name}: {exc}")
        calls.append(ParsedToolCall(id=new_call_id(), name=name,
                                    arguments=json.dumps(args, ensure_ascii=False)))
        pos = end + len(CALL_CLOSE)
    content = "".join(pieces)
    return ParsedAssistant(content=content if content or not calls else None,
                           reasoning_content=reasoning, tool_calls=calls)


class Gemma4Codec(TemplateCodec):
    """Gemma 4 (see module doc); the tokenizer's own template decides every render."""

    family = "gemma4"

    def __init__(self, tokenizer: Any, probe: ProbeResult | None = None) -> None:
        super().__init__(tokenizer, probe)
        if not self.probe.eot_ids:
            raise TemplateNotSupported("gemma4: the template renders no end-of-turn token")
        self._turn_close = self.probe.eot_ids[0]
        self._call_close = self._one_id(CALL_CLOSE)
        try:
            self._tool_stop = self._derive_tool_stop()
            self._thought = self._derive_thought()
        except TemplateNotSupported:
            raise
        except Exception as exc:
            raise TemplateNotSupported(f"gemma4: template failed on a probe: {exc}") from exc
        self.eot_ids = tuple(dict.fromkeys((*self.eot_ids, self._tool_stop)))
        self.stop_token_ids = tuple(dict.fromkeys((*self.eot_ids, *self.stop_token_ids)))
        self._heads: dict[str, tuple[str, str, str]] = {}

    # -- what the template says, read once ---------------------------------------

    def _one_id(self, token: str) -> int:
        ids = self._ids_of((token,))
        if not ids:
            raise TemplateNotSupported(f"gemma4: the tokenizer lacks {token}")
        return ids[0]

    def _derive_tool_stop(self) -> int:
        """The token after the last `<tool_call|>` of a message no result answers yet."""
        base = [DUMMY_SYSTEM, DUMMY_USER]
        msg = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
        text = self._render([*base, msg], tools=None, gen=False, template_kwargs=None)
        at = text.rfind(CALL_CLOSE)
        after = encode(self.tokenizer, text[at + len(CALL_CLOSE) :]) if at >= 0 else []
        if not after or after[0] not in self.probe.eot_ids + self._ids_of(("<|tool_response>",)):
            raise TemplateNotSupported("gemma4: no stop token after a tool call")
        return after[0]

    def _derive_thought(self) -> tuple[str, str]:
        """(opener, closer) the template wraps reasoning in: `<|channel>thought\\n`, `\\n<channel|>`."""
        msg = {"role": "assistant", "content": "", "reasoning_content": _MARK, "tool_calls": [_PROBE_CALL]}
        text = self._render([DUMMY_SYSTEM, DUMMY_USER, msg], tools=None, gen=False, template_kwargs=None)
        at = text.find(_MARK)
        opens = text.rfind(CHANNEL_OPEN, 0, at)
        closes = text.find(CHANNEL_CLOSE, at)
        if at < 0 or opens < 0 or closes < 0:
            return CHANNEL_OPEN + "thought\n", "\n" + CHANNEL_CLOSE
        return text[opens:at], text[at + len(_MARK) : closes + len(CHANNEL_CLOSE)]

    def _head(self, kw: Mapping[str, Any] | None) -> tuple[str, str, str]:
        """(render of the dummy query, turn header of a history assistant turn, what the
        generation prompt adds after it): (..., "<|turn>model\\n", "<|channel>thought\\n<channel|>")
        with thinking off. Cached per kwargs: every turn's diagnostic needs it."""
        key = json.dumps(dict(kw or {}), sort_keys=True, default=str)
        hit = self._heads.get(key)
        if hit is not None:
            return hit
        base = [DUMMY_SYSTEM, DUMMY_USER]
        hist = self._render(base, tools=None, gen=False, template_kwargs=kw)
        gen = self._render(base, tools=None, gen=True, template_kwargs=kw)
        full = self._render([*base, {"role": "assistant", "content": _MARK}], tools=None, gen=False,
                            template_kwargs=kw)
        if not gen.startswith(hist) or not full.startswith(hist) or _MARK not in full:
            raise CodecError("gemma4: the template's assistant turn does not follow the prompt")
        header = full[len(hist) : full.index(_MARK)]
        prompt = gen[len(hist) :]
        if not prompt.startswith(header):
            raise CodecError("gemma4: the generation prompt does not start with the turn header")
        self._heads[key] = (hist, header, prompt[len(header) :])
        return self._heads[key]

    # -- ChatCodec ---------------------------------------------------------------

    def thinking(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """On only when `enable_thinking` is truthy (the template's own default is off)."""
        return bool((template_kwargs or {}).get("enable_thinking"))

    def close_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        """[] after a stop; the tool stop after a cut `<tool_call|>`; else `<turn|>`."""
        if sampled_ids and sampled_ids[-1] in self.eot_ids:
            return []
        if sampled_ids and sampled_ids[-1] == self._call_close:
            return [self._tool_stop]
        return [self._turn_close]

    def canonical_assistant_ids(
        self, message: Message, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The body the template renders for `message` after the turn header, through
        its stop (`<turn|>` or the tool stop); with thinking on, reasoning the template
        does not render (a plain answer) is what the model emitted first."""
        kw = self._internal_kwargs(template_kwargs)
        base = [DUMMY_SYSTEM, DUMMY_USER]
        try:
            hist, header, _ = self._head(kw)
            full = self._render([*base, message], tools=None, gen=False, template_kwargs=kw)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"{self.family}: cannot render assistant message: {exc}") from exc
        if not full.startswith(hist + header):
            raise CodecError(f"{self.family}: assistant render does not start with the turn header")
        body = full[len(hist) + len(header) :]
        gap = decode_text(self.tokenizer, self.probe.gap_ids)
        if gap and body.endswith(TURN_CLOSE + gap):
            body = body[: -len(gap)]
        reasoning = message.get("reasoning_content")
        if reasoning and self.thinking(kw) and not body.startswith(CHANNEL_OPEN):
            body = self._thought[0] + str(reasoning) + self._thought[1] + body
        pre = encode(self.tokenizer, hist + header)
        ids = encode(self.tokenizer, hist + header + body)
        ids = ids[len(pre) :] if is_prefix(pre, ids) else encode(self.tokenizer, body)
        if not ids or ids[-1] not in self.eot_ids:
            raise CodecError(f"{self.family}: assistant render does not end in a stop token")
        return ids

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
        """TEMPLATE with `committed`: the full re-render must extend every committed id
        (else HISTORY_REWRITE). Otherwise the delta after the sampled stop, from a base
        of the previous message alone (O(turn)), and a last-turn rewrite diagnostic."""
        refusal = check_bridge_input(history, committed_tail, new_messages,
                                     roles=("user", "tool", "system", "assistant", "developer"),
                                     closing_ids=self.eot_ids, tail_required=True)
        if refusal is not None:
            return refusal
        last = committed_tail[-1]
        kw = self._internal_kwargs(template_kwargs)
        new = list(new_messages)
        if policy == HistoryPolicy.TEMPLATE and committed is not None:
            return self._bridge_exact([*history, *new], committed, tools=tools, kw=kw)
        prev = dict(history[-1])
        base_prev = {k: v for k, v in prev.items() if k != "reasoning_content"}
        if prev.get("tool_calls") and new[0].get("role") == "tool":
            base_prev["content"] = ""  # rendered after the results; the model sampled it before the stop
        base = [DUMMY_SYSTEM, DUMMY_USER, base_prev]
        try:
            ids_b = self._ids(base, tools=tools, gen=False, template_kwargs=kw)
            ids_bn = self._ids([*base, *new], tools=tools, gen=True, template_kwargs=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        if not is_prefix(ids_b, ids_bn) or len(ids_bn) == len(ids_b):
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "render(B) is not a prefix of render(B + new)")
        at = max((i for i, t in enumerate(ids_b) if t == last), default=-1)
        if at < 0 or ids_b[at + 1 :] not in ([], list(self.probe.gap_ids)):
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY,
                                 "the template does not close this message with the sampled stop token")
        rewrites, offset = self._last_turn_rewrite(prev, new, kw=kw)
        if rewrites and policy == HistoryPolicy.TEMPLATE:
            return BridgeRefusal(RefusalReason.HISTORY_REWRITE,
                                 "the template re-renders the last turn when these messages are appended")
        return BridgeResult(prompt_ids=ids_bn[at + 1 :], rewrites_history=rewrites, rewrite_offset=offset)

    def _bridge_exact(self, messages: list[Message], committed: Sequence[int], *, tools: Any,
                      kw: Mapping[str, Any]) -> BridgeResult | BridgeRefusal:
        """TEMPLATE policy: the full re-render past every committed id, or HISTORY_REWRITE
        (sees the dropped prefill and reasoning token for token). O(context)."""
        try:
            full = self._ids(messages, tools=tools, gen=True, template_kwargs=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        return extend_committed(full, committed)

    def _last_turn_rewrite(self, prev: Message, new: list[Message], *,
                           kw: Mapping[str, Any]) -> tuple[bool, int | None]:
        """Whether a re-render of the last message with `new` after it differs from what
        the model saw (prompt + canonical sample), and where in its output (None: in the
        prompt, e.g. the dropped thought prefill). A diagnostic: never fails a turn.
        Without the tool declarations (they render only in the system turn)."""
        base = [DUMMY_SYSTEM, DUMMY_USER]
        try:
            hist, header, prefill = self._head(kw)
            seen = encode(self.tokenizer, hist + header + prefill)
            head = len(seen)
            seen += self.canonical_assistant_ids(prev, template_kwargs=kw)
            again = self._ids([*base, prev, *new], tools=None, gen=True, template_kwargs=kw)
        except Exception:
            return True, None
        if is_prefix(seen, again):
            return False, None
        j = next((i for i, (x, y) in enumerate(zip(seen, again, strict=False)) if x != y),
                 min(len(seen), len(again)))
        return True, (j - head if j >= head else None)

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        """A leading thought channel is reasoning (in both modes: `<|channel>` is a
        control token, never content: the template strips it from content), then calls."""
        reasoning = None
        if text.startswith(CHANNEL_OPEN):
            opener, closer = self._thought
            end = text.find(CHANNEL_CLOSE)
            inner = text[len(CHANNEL_OPEN) : end if end >= 0 else len(text)]
            label = opener[len(CHANNEL_OPEN) :]
            inner = inner[len(label) :] if inner.startswith(label) else inner
            pad = closer[: -len(CHANNEL_CLOSE)]
            if end >= 0 and pad and inner.endswith(pad):
                inner = inner[: -len(pad)]
            reasoning = inner
            text = "" if end < 0 else text[end + len(CHANNEL_CLOSE) :]
        return parse_gemma4_calls(text, reasoning, names)
