"""A JSON value read in pieces and re-written as `json.dumps(value, ensure_ascii=False)`.

Why: a committed tool call's `arguments` is the canonical dump of the parsed object
(`parsing._dump`), not the model's own text (`{"a":1}`, `"\\u00e9"`, `1e5` all differ
from it). To stream arguments while they are sampled each completed piece
of the model's JSON is written the way `json.dumps` would write it, so the concatenated
output is the canonical text and every intermediate output is a prefix of it: brackets,
`, ` and `: ` separators as the structure arrives, string characters as they decode
(a `\\uXXXX` surrogate pair once whole), numbers once a delimiter ends them, literals
once complete. It accepts exactly what `json.JSONDecoder` (strict, NaN/Infinity on)
accepts; anything else raises `JsonStreamError`, and so does a duplicate key in an
object (json keeps the last value at the first key's place: no prefix of the canonical
text could be streamed), detected when the key's string completes. Pure, no I/O; work
per `feed` follows the new text (plain string runs are taken by one regex match).
"""

from __future__ import annotations

import re

__all__ = ["CanonicalJson", "DuplicateKey", "JsonStreamError"]


class JsonStreamError(ValueError):
    """The text is not one JSON value `json.loads` accepts, or an object repeats a key."""


class DuplicateKey(JsonStreamError):
    """An object repeats a key: valid JSON (`json.loads` keeps the last value), but no
    prefix of its canonical text can be streamed. Readers that ask "can this still be
    JSON?" (GLM values, `incremental.GlmCalls`) must not read it as a syntax error."""


_WS = " \t\n\r"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?")
_NUM_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"true": "true", "false": "false", "null": "null", "NaN": "NaN", "Infinity": "Infinity",
             "-Infinity": "-Infinity"}
_SHORT = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPE_OUT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    """One decoded character as `json.dumps(..., ensure_ascii=False)` writes it in a string."""
    out = _ESCAPE_OUT.get(ch)
    if out is not None:
        return out
    return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 else ch


def _escape_run(text: str) -> str:
    return "".join(_escape(c) for c in text)


def _number(tok: str) -> str:
    """A number token as json writes the value it decodes to (int or float repr)."""
    m = _NUMBER.fullmatch(tok)
    if m is None:
        raise JsonStreamError(f"bad number {tok[:40]!r}")
    integer, frac, exp = m.groups()
    try:
        if frac or exp:
            value = float(tok)
            if value != value:
                return "NaN"
            if value in (float("inf"), float("-inf")):
                return "Infinity" if value > 0 else "-Infinity"
            return float.__repr__(value)
        return str(int(integer))
    except ValueError as exc:  # e.g. more digits than int() converts
        raise JsonStreamError(str(exc)) from exc


class CanonicalJson:
    """One JSON value fed in pieces; `feed` returns the canonical text now certain.

    `done` once the value ended (a top-level number needs the next character); `rest`
    is the text after it. After an error the instance is spent."""

    def __init__(self) -> None:
        self._stack: list[set[str] | None] = []  # per open container: keys seen (object) or None (array)
        self._state = "value"
        self._tok = ""  # a number or literal being read; the escape being read
        self._key: list[str] | None = None  # the decoded key being read (keys are held until complete)
        self._high = ""  # a high surrogate from `\\uD8xx`, waiting for its low half
        self.done = False
        self.rest = ""

    def feed(self, text: str) -> str:
        out: list[str] = []
        i, n = 0, len(text)
        while i < n and not self.done:
            i = getattr(self, "_" + self._state)(text, i, out)
        if self.done:
            self.rest += text[i:]
        return "".join(out)

    # -- structure --------------------------------------------------------------------

    def _value(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch in _WS:
            return i + 1
        if ch == "{":
            self._stack.append(set())
            out.append("{")
            self._state = "key_first"
        elif ch == "[":
            self._stack.append(None)
            out.append("[")
            self._state = "item_first"
        elif ch == '"':
            out.append('"')
            self._state = "string"
        elif ch in "-0123456789":
            self._tok, self._state = ch, "number"
        elif ch in "tfnNI":
            self._tok, self._state = ch, "literal"
        else:
            raise JsonStreamError(f"unexpected {ch!r} where a value starts")
        return i + 1

    def _key_first(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch in _WS:
            return i + 1
        if ch == "}":
            return self._close(out, "}", i)
        return self._key_next(text, i, out)

    def _key_next(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch in _WS:
            return i + 1
        if ch != '"':
            raise JsonStreamError(f"unexpected {ch!r} where a key starts")
        self._key, self._state = [], "string"
        return i + 1

    def _item_first(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch in _WS:
            return i + 1
        if ch == "]":
            return self._close(out, "]", i)
        self._state = "value"
        return i

    def _colon(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch in _WS:
            return i + 1
        if ch != ":":
            raise JsonStreamError(f"unexpected {ch!r} where ':' belongs")
        out.append(": ")
        self._state = "value"
        return i + 1

    def _after(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch in _WS:
            return i + 1
        top = self._stack[-1]
        if ch == ",":
            out.append(", ")
            self._state = "value" if top is None else "key_next"
            return i + 1
        if ch == ("]" if top is None else "}"):
            return self._close(out, ch, i)
        raise JsonStreamError(f"unexpected {ch!r} after a value")

    def _close(self, out: list[str], ch: str, i: int) -> int:
        self._stack.pop()
        out.append(ch)
        self._ended()
        return i + 1

    def _ended(self) -> None:
        """A value completed: the container's next separator, or the end of the value."""
        if self._stack:
            self._state = "after"
        else:
            self.done, self._state = True, "end"

    # -- scalars ----------------------------------------------------------------------

    def _number(self, text: str, i: int, out: list[str]) -> int:
        j = i
        while j < len(text) and text[j] in _NUM_CHARS:
            j += 1
        self._tok += text[i:j]
        if j == len(text):
            return j  # more digits may follow
        if self._tok == "-" and text[j] == "I":
            self._state = "literal"
            return j
        out.append(_number(self._tok))
        self._tok = ""
        self._ended()
        return j

    def _literal(self, text: str, i: int, out: list[str]) -> int:
        self._tok += text[i]
        if self._tok in _LITERALS:
            out.append(_LITERALS[self._tok])
            self._tok = ""
            self._ended()
        elif not any(lit.startswith(self._tok) for lit in _LITERALS):
            raise JsonStreamError(f"bad literal {self._tok!r}")
        return i + 1

    # -- strings ----------------------------------------------------------------------

    def _put(self, out: list[str], decoded: str) -> None:
        """Decoded string characters: into the key being read, or out (escaped)."""
        if self._key is not None:
            self._key.append(decoded)
        else:
            out.append(_escape_run(decoded))

    def _flush_high(self, out: list[str]) -> None:
        if self._high:
            self._put(out, self._high)
            self._high = ""

    def _string(self, text: str, i: int, out: list[str]) -> int:
        if self._high and text[i] != "\\":
            self._flush_high(out)  # a lone high surrogate: json keeps it as is
        m = _PLAIN.match(text, i)
        if m is not None:
            self._put(out, m.group())
            return m.end()
        ch = text[i]
        if ch == '"':
            self._end_string(out)
        elif ch == "\\":
            self._tok, self._state = "", "escape"
        else:
            raise JsonStreamError(f"invalid control character {ch!r} in a string")
        return i + 1

    def _escape(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch == "u":
            self._state = "unicode"
            return i + 1
        self._flush_high(out)
        if ch not in _SHORT:
            raise JsonStreamError(f"invalid escape \\{ch}")
        self._put(out, _SHORT[ch])
        self._state = "string"
        return i + 1

    def _unicode(self, text: str, i: int, out: list[str]) -> int:
        ch = text[i]
        if ch not in _HEX:
            raise JsonStreamError("invalid \\uXXXX escape")
        self._tok += ch
        if len(self._tok) == 4:
            code, self._tok, self._state = int(self._tok, 16), "", "string"
            if self._high and 0xDC00 <= code <= 0xDFFF:
                high, self._high = ord(self._high), ""
                self._put(out, chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
            else:
                self._flush_high(out)
                if 0xD800 <= code <= 0xDBFF:
                    self._high = chr(code)  # its low half may follow
                else:
                    self._put(out, chr(code))
        return i + 1

    def _end_string(self, out: list[str]) -> None:
        self._flush_high(out)
        if self._key is None:
            out.append('"')
            self._ended()
            return
        key, self._key = "".join(self._key), None
        keys = self._stack[-1]
        assert keys is not None
        if key in keys:
            raise DuplicateKey(f"duplicate key {key[:40]!r}")
        keys.add(key)
        out.append('"' + _escape_run(key) + '"')
        self._state = "colon"

    def _end(self, text: str, i: int, out: list[str]) -> int:  # pragma: no cover - feed stops at done
        return len(text)
