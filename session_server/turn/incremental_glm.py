"""GLM-4.5/4.6 XML tool calls streamed while sampled, as `parse_glm` reads them.

A GLM call is `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`;
`parse_glm` keeps each value as `json.loads(V)` when that succeeds, else the raw string,
and commits `json.dumps(args, ensure_ascii=False)`. `GlmCalls` writes that canonical text
as the markup arrives and only what no later text can change:

- the name once `<arg_key>` (or `</tool_call>`: no arguments) ends it, offered and passing
  parse_glm's checks; then `{`;
- `"K": ` (with `, ` between pairs) once `</arg_key>` and `<arg_value>` follow each other
  (anything else between them may still make the regex read a longer key: stop);
- a value that can no longer be JSON (`CanonicalJson` rejects a prefix of it, or a whole
  JSON value is followed by more than whitespace) is certainly a raw string: streamed as
  JSON string characters, holding back what may start a closing marker. Any other value
  waits for `</arg_value>` and is written by parse_glm's own `_glm_value`;
- `}` at `</tool_call>`; the next call after whitespace.

Anything parse_glm would reject (a nested `<tool_call>`, text between calls, a duplicate
key, a marker where it does not belong) stops the stream for the rest of the turn: what
was not streamed is sent once the whole message is parsed (live.py), and a streamed call
the final parse reads differently is counted as a divergence there. The text handed over
may start with content (`FieldSplitter` hands GLM content that begins with whitespace
over whole, since it is stripped only when the calls parse): it is skipped up to the
first `<tool_call>`, exactly as `parse_glm` splits it off.
"""

from __future__ import annotations

import json

from trajectory.codec.json_stream import CanonicalJson, DuplicateKey, JsonStreamError
from trajectory.codec.parsing import TOOL_CLOSE, TOOL_OPEN, _glm_value

from .incremental_calls import CallArgs, CallStart, partial_marker

__all__ = ["GlmCalls"]

KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
_JSON_WS = " \t\r\n"  # what json.loads skips around a value

Piece = CallStart | CallArgs


def _escape(text: str) -> str:
    """`text` as json.dumps(ensure_ascii=False) writes it inside a string (per character,
    so pieces concatenate to the whole string's escape)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Value:
    """One `<arg_value>` body read in pieces: streamed once it is certainly a raw string,
    else written whole at its end as parse_glm writes it."""

    def __init__(self) -> None:
        self._raw: list[str] = []
        self._probe: CanonicalJson | None = CanonicalJson()  # None: json.loads decides at the end
        self.string = False  # json.loads will fail: the value is the raw text, streamed

    def feed(self, text: str) -> str:
        if not text:
            return ""
        if self.string:
            return _escape(text)
        self._raw.append(text)
        if self._may_be_json(text):
            return ""
        self.string = True
        return '"' + _escape("".join(self._raw))

    def _may_be_json(self, text: str) -> bool:
        """Whether some continuation of the value so far is text json.loads accepts."""
        if self._probe is None:
            return True
        try:
            self._probe.feed(text)
        except DuplicateKey:  # valid JSON all the same: the end decides
            self._probe = None
            return True
        except JsonStreamError:
            return False
        return not (self._probe.done and self._probe.rest.strip(_JSON_WS))

    def end(self) -> str:
        if self.string:
            return '"'
        return json.dumps(_glm_value("".join(self._raw)), ensure_ascii=False)


class GlmCalls:
    """Tool calls of the text from the end of reasoning on, streamed as `parse_glm` will
    read them (see the module docstring). States: `seek` (content before the first call),
    `name`, `key`, `key_end` (after `</arg_key>`), `value`, `pairs` (after a value or the
    first `<arg_key>`'s absence), `between` (after `</tool_call>`)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.index = 0  # the call being read
        self.stopped = False
        self._state = "seek"
        self._buf = ""
        self._scan = 0  # no marker starts in `_buf` before this
        self._keys: set[str] = set()
        self._keyname = ""
        self._val = _Value()

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.stopped:
            return out
        self._buf += text
        while not self.stopped and getattr(self, "_" + self._state)(out):
            pass
        return out

    def _stop(self) -> bool:
        self.stopped, self._buf = True, ""
        return False

    def _to(self, state: str, consumed: int) -> bool:
        self._state, self._buf, self._scan = state, self._buf[consumed:], 0
        return True

    def _find(self, *markers: str) -> tuple[int, str] | None:
        """The first of `markers` in `_buf` (the earliest, then the first listed)."""
        hits = [(i, m) for m in markers if (i := self._buf.find(m, self._scan)) >= 0]
        if hits:
            return min(hits, key=lambda h: h[0])
        self._scan = max(0, len(self._buf) - max(len(m) for m in markers) + 1)
        return None

    def _held(self, *markers: str) -> int:
        """How much of `_buf`'s end may still start one of `markers`."""
        return max(partial_marker(self._buf, m) for m in markers)

    def _seek(self, out: list[Piece]) -> bool:
        hit = self._find(TOOL_OPEN)
        if hit is None:
            self._buf = self._buf[len(self._buf) - self._held(TOOL_OPEN):]
            self._scan = 0
            return False
        return self._to("name", hit[0] + len(TOOL_OPEN))

    def _name(self, out: list[Piece]) -> bool:
        hit = self._find(KEY_OPEN, TOOL_CLOSE)
        if hit is None:
            sofar = self._buf[: len(self._buf) - self._held(KEY_OPEN, TOOL_CLOSE)].strip()
            if "<" in sofar or "\n" in sofar or not any(n.startswith(sofar) for n in self.names):
                return self._stop()  # parse_glm rejects whatever name this becomes
            return False
        i, marker = hit
        name = self._buf[:i].strip()
        if not name or "<" in name or "\n" in name or name not in self.names:
            return self._stop()
        out.append(CallStart(self.index, name))
        self._keys = set()
        if marker == TOOL_CLOSE:
            out.append(CallArgs(self.index, "{}"))
            return self._end_call(i)
        out.append(CallArgs(self.index, "{"))
        return self._to("key", i + len(KEY_OPEN))

    def _end_call(self, i: int) -> bool:
        self.index += 1
        return self._to("between", i + len(TOOL_CLOSE))

    def _key(self, out: list[Piece]) -> bool:
        hit = self._find(KEY_CLOSE, TOOL_OPEN, TOOL_CLOSE)
        if hit is None:
            return False
        i, marker = hit
        if marker != KEY_CLOSE:
            return self._stop()  # the body ends (or a call nests) inside a key: no pair matches
        self._keyname = self._buf[:i].strip()
        return self._to("key_end", i + len(KEY_CLOSE))

    def _key_end(self, out: list[Piece]) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf.startswith(VALUE_OPEN):
            return False if VALUE_OPEN.startswith(self._buf) else self._stop()
        if self._keyname in self._keys:
            return self._stop()  # json keeps the last value at the first key's place
        sep = ", " if self._keys else ""
        self._keys.add(self._keyname)
        out.append(CallArgs(self.index, sep + json.dumps(self._keyname, ensure_ascii=False) + ": "))
        self._val = _Value()
        return self._to("value", len(VALUE_OPEN))

    def _value(self, out: list[Piece]) -> bool:
        markers = (VALUE_CLOSE, TOOL_OPEN, TOOL_CLOSE)
        hit = self._find(*markers)
        if hit is None:
            n = len(self._buf) - self._held(*markers)
            self._emit(out, self._val.feed(self._buf[:n]))
            self._buf, self._scan = self._buf[n:], 0
            return False
        i, marker = hit
        if marker != VALUE_CLOSE:
            return self._stop()
        self._emit(out, self._val.feed(self._buf[:i]) + self._val.end())
        return self._to("pairs", i + len(VALUE_CLOSE))

    def _emit(self, out: list[Piece], text: str) -> None:
        if text:
            out.append(CallArgs(self.index, text))

    def _pairs(self, out: list[Piece]) -> bool:
        self._buf = self._buf.lstrip()
        if self._buf.startswith(KEY_OPEN):
            return self._to("key", len(KEY_OPEN))
        if self._buf.startswith(TOOL_CLOSE):
            out.append(CallArgs(self.index, "}"))
            return self._end_call(0)
        if KEY_OPEN.startswith(self._buf) or TOOL_CLOSE.startswith(self._buf):
            return False
        return self._stop()

    def _between(self, out: list[Piece]) -> bool:
        self._buf = self._buf.lstrip()
        if self._buf.startswith(TOOL_OPEN):
            return self._to("name", len(TOOL_OPEN))
        return False if TOOL_OPEN.startswith(self._buf) else self._stop()
