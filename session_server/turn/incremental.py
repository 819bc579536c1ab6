"""Incremental text of a turn being sampled: per-chunk work follows the new tokens.

`IncrementalDecoder` decodes only the new ids (in a window from the last clean cut, so
a multi-byte character split across tokens is held back while its text ends in U+FFFD),
and `FieldSplitter` splits that text into reasoning and content with a small state
machine driven by the codec's markers (`<think>`, `</think>`, `<tool_call>`), holding
back only what more tokens could still change: a suffix that may start a marker, the
whitespace the parsers strip, content once a tool call opens. It mirrors the parse of
the families it covers: `markup_for` builds the markup of the incremental parser kind
the family registry declares for the codec (`trajectory.codec.families`); a codec
whose kind is NONE falls back to the whole-parse `TextStreamer` (off the loop). What it holds back is sent by `TextStreamer.tail`-style
checks once the whole message is parsed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trajectory.codec.families import IncrementalKind, incremental_parser
from trajectory.codec.json_stream import CanonicalJson, JsonStreamError
from trajectory.codec.parsing import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN
from trajectory.codec.probe import decode_text

from .incremental_calls import CallArgs, CallReader, CallStart, partial_marker
from .incremental_glm import GlmCalls

__all__ = [
    "FieldSplitter", "Markup", "HermesCalls", "IncrementalDecoder",
    "IncrementalText", "calls_for", "markup_for",
]


@dataclass(frozen=True)
class Markup:
    """How a family's `parse_text` shapes the fields (what the splitter must mirror)."""

    think: bool  # thinking on and the family splits `<think>...</think>`
    tools: bool  # the request offered tools: `<tool_call>` opens a call
    reasoning_ws: str | None = "\n"  # what reasoning is stripped of (None: all whitespace)
    lstrip_after_think: bool = True  # content after a reasoning block loses leading newlines
    glm_content: bool = False  # content is `.strip()`ped, but raw when a call fails to parse
    hermes: bool = False  # calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (parse_hermes)
    glm: bool = False  # calls are `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>` (parse_glm)


def markup_for(codec: Any, *, tools: bool, template_kwargs: Mapping[str, Any] | None) -> Markup | None:
    """The markup of `codec`'s parse, from the incremental parser kind the family
    registry declares for it; None when no parser here mirrors it (kind NONE)."""
    parser = incremental_parser(codec)
    if parser.kind is IncrementalKind.PLAIN:
        return Markup(think=False, tools=False)
    calls = tools and parser.tool_calls
    if parser.kind is IncrementalKind.HERMES:
        thinking = parser.reasoning and bool(codec.thinking(template_kwargs))
        return Markup(think=thinking, tools=calls, hermes=calls)
    if parser.kind is IncrementalKind.GLM:
        thinking = parser.reasoning and bool(codec.thinking(template_kwargs))
        return Markup(think=thinking, tools=calls, reasoning_ws=None, lstrip_after_think=False, glm_content=True,
                       glm=calls)
    return None


class IncrementalDecoder:
    """Text of the ids so far, decoded a few ids at a time. A trailing stop id (the codec
    drops it before parsing) is held until another id follows it."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] = (), *, context: int = 4) -> None:
        self._tok, self._stops, self._n = tokenizer, frozenset(int(t) for t in stop_ids), context
        self._ctx: list[int] = []  # the last few ids already sent: their text decodes the next ones in context
        self._ctx_text = ""
        self._pending: list[int] = []  # ids whose text is not sent yet (a split character)
        self._held: list[int] = []

    def feed(self, ids: Sequence[int]) -> str:
        """The new text once `ids` (the new ones only) are known."""
        new = [*self._held, *(int(t) for t in ids)]
        self._held = [new.pop()] if new and new[-1] in self._stops else []
        if not new:
            return ""
        self._pending += new
        window = [*self._ctx, *self._pending]
        text = decode_text(self._tok, window)
        if text.endswith("\ufffd") or not text.startswith(self._ctx_text):
            return ""  # a character split across tokens: wait for its last byte
        out = text[len(self._ctx_text) :]
        self._ctx, self._pending = window[-self._n :], []
        self._ctx_text = decode_text(self._tok, self._ctx)
        return out





class FieldSplitter:
    """Reasoning / content deltas of a text fed in pieces, as `Markup`'s parse gives them
    for the whole text, minus what could still change. States: `pre` (maybe `<think>`),
    `unknown` (thinking on, no `<think>`: wait for `</think>`), `reason`, `content`, `done`."""

    def __init__(self, markup: Markup) -> None:
        self.g = markup
        self.state = "pre" if markup.think else "content"
        self._buf = ""  # text of the current state not yet sent
        self._scan = 0  # no marker starts in `_buf` before this
        self._started = False  # the current field's leading strip is done
        self._after_think = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(field, delta) pairs, field `reasoning_content` or `content`."""
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            state = self.state
            getattr(self, "_" + state)(out)
            if self.state == state:
                return out

    def _find(self, marker: str) -> int:
        i = self._buf.find(marker, self._scan)
        self._scan = max(0, len(self._buf) - len(marker) + 1) if i < 0 else i
        return i

    def _drop(self, n: int) -> None:
        self._buf, self._scan = self._buf[n:], max(0, self._scan - n)

    def _to(self, state: str) -> None:
        self.state, self._scan, self._started = state, 0, False

    def _pre(self, out: list[tuple[str, str]]) -> None:
        s = self._buf.lstrip()
        if THINK_OPEN.startswith(s):
            return
        if s.startswith(THINK_OPEN):
            self._buf = s[len(THINK_OPEN) :]
            self._to("reason")
        else:
            self._to("unknown")

    def _unknown(self, out: list[tuple[str, str]]) -> None:
        i = self._find(THINK_CLOSE)
        if i < 0:
            return
        head = self._buf[:i]
        if THINK_OPEN in head:
            head = head.split(THINK_OPEN, 1)[1]
        self._buf = self._buf[i:]
        self._to("reason")
        self._reason_text(out, head, final=True)
        self._close_think()

    def _reason(self, out: list[tuple[str, str]]) -> None:
        i = self._find(THINK_CLOSE)
        if i >= 0:
            self._reason_text(out, self._buf[:i], final=True)
            self._drop(i)
            self._close_think()
            return
        avail = len(self._buf) - partial_marker(self._buf, THINK_CLOSE)
        self._drop(self._reason_text(out, self._buf[:avail], final=False))

    def _close_think(self) -> None:
        self._drop(len(THINK_CLOSE))
        self._after_think = True
        self._to("content")

    def _reason_text(self, out: list[tuple[str, str]], text: str, *, final: bool) -> int:
        """Send reasoning from `text` (the start of `_buf`); how many chars it consumed."""
        ws, used = self.g.reasoning_ws, 0
        if not self._started:
            stripped = text.lstrip(ws)
            used = len(text) - len(stripped)
            text = stripped
            if not text:
                return used
            self._started = True
        body = text.rstrip(ws)
        if body:
            out.append(("reasoning_content", body))
        return used + len(body)

    def _content(self, out: list[tuple[str, str]]) -> None:
        g = self.g
        if not self._started:
            if self._after_think and g.lstrip_after_think:
                self._drop(len(self._buf) - len(self._buf.lstrip("\n")))
            if not self._buf:
                return
            if g.glm_content:
                if g.tools and self._buf[0].isspace():  # raw on a failed call, stripped otherwise
                    self._to("done")
                    return
                self._drop(len(self._buf) - len(self._buf.lstrip()))
                if not self._buf:
                    return
            self._started = True
        end, last = len(self._buf), False
        if g.tools:
            i = self._find(TOOL_OPEN)
            end, last = (i, True) if i >= 0 else (end - partial_marker(self._buf, TOOL_OPEN), False)
        body = self._buf[:end]
        if last and g.hermes:  # parse_hermes drops one newline: a prefix of the content, call or no call
            body = body[:-1] if body.endswith("\n") else body
        elif g.tools or g.glm_content:
            body = body.rstrip()
        if body:
            out.append(("content", body))
        self._drop(len(body))
        if last:
            self._to("done")

    def _done(self, out: list[tuple[str, str]]) -> None:
        pass  # the text from the first `<tool_call>` on waits in `_buf` for `take`

    def take(self) -> str:
        """In state `done`: the text not sent as a field (the calls), handed over once."""
        text, self._buf, self._scan = self._buf, "", 0
        return text


_JSON_WS = " \t\r\n"  # what parse_hermes skips around and between calls
_NAME, _ARGS = 0, 1  # the steps of `HermesCalls._STEPS` that are JSON values
# a call as parse_hermes reads it, in the one key order streamed: anything else holds the call back
_STEPS: tuple[str | int, ...] = (TOOL_OPEN, "{", '"name"', ":", _NAME, ",", '"arguments"', ":", _ARGS, "}", TOOL_CLOSE)


class HermesCalls:
    """Tool calls of the text from the first `<tool_call>` on, streamed as `parse_hermes`
    will read them: `<tool_call>{"name": N, "arguments": {...}}</tool_call>`, whitespace
    between tokens. `CallStart` once N is complete and one of `names` and the arguments
    object opened; `CallArgs` as `CanonicalJson` re-writes the arguments. Anything else
    (another key order, an unknown name, invalid JSON, a duplicate key, text after a
    call) stops the stream for the rest of the turn: what was not streamed is sent after
    the whole message is parsed (live.py), which is the truth."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.index = 0  # the call being read
        self.stopped = False
        self._step = 0
        self._lit = ""  # the part of a literal step matched so far
        self._json: CanonicalJson | None = None
        self._name = ""

    def feed(self, text: str) -> list[CallStart | CallArgs]:
        out: list[CallStart | CallArgs] = []
        try:
            while text and not self.stopped:
                text = self._advance(text, out)
        except JsonStreamError:
            self.stopped = True
        return out

    def _advance(self, text: str, out: list[CallStart | CallArgs]) -> str:
        step = _STEPS[self._step]
        if isinstance(step, str):
            return self._literal(step, text)
        if self._json is None:
            text = text.lstrip(_JSON_WS)
            if not text:
                return ""
            self._json = CanonicalJson()
            if step == _ARGS:
                if text[0] != "{":
                    self.stopped = True  # arguments as a string (or not an object): the end-of-turn path
                    return ""
                out.append(CallStart(self.index, self._name))
        piece = self._json.feed(text)
        if step == _ARGS:
            if piece:
                out.append(CallArgs(self.index, piece))
        else:
            self._name += piece
        if not self._json.done:
            return ""
        rest, self._json = self._json.rest, None
        if step == _NAME:
            name = json.loads(self._name)
            if not isinstance(name, str) or name not in self.names:
                self.stopped = True
                return ""
            self._name = name
        self._step += 1
        return rest

    def _literal(self, lit: str, text: str) -> str:
        if not self._lit:
            text = text.lstrip(_JSON_WS)
            if not text:
                return ""
        need = lit[len(self._lit):]
        take = text[: len(need)]
        if not need.startswith(take):
            self.stopped = True
            return ""
        self._lit += take
        if len(take) < len(need):
            return ""
        self._lit = ""
        self._step += 1
        if self._step == len(_STEPS):  # a call read whole: the next may follow
            self._step, self.index, self._name = 0, self.index + 1, ""
        return text[len(take):]


def calls_for(markup: Markup, names: frozenset[str]) -> CallReader | None:
    """The tool-call reader of `markup`'s family (hermes JSON, GLM XML), or None: then
    calls are sent whole once the message is parsed."""
    if markup.hermes:
        return HermesCalls(names)
    if markup.glm:
        return GlmCalls(names)
    return None


class IncrementalText:
    """Decoder and splitter together: new ids in, (field, delta) pairs out; with `calls`
    (`calls_for`: the request's tool names), then the tool-call pieces."""

    def __init__(self, decoder: IncrementalDecoder, splitter: FieldSplitter, calls: CallReader | None = None) -> None:
        self.decoder, self.splitter, self.calls = decoder, splitter, calls

    def feed(self, ids: Sequence[int]) -> list[tuple[str, str] | CallStart | CallArgs]:
        text = self.decoder.feed(ids)
        if not text:
            return []
        out: list[tuple[str, str] | CallStart | CallArgs] = [*self.splitter.feed(text)]
        if self.calls is not None and self.splitter.state == "done":
            out += self.calls.feed(self.splitter.take())
        return out
