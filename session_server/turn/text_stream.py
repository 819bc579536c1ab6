"""The text of a turn being sampled that is certainly in its committed message.

`TextStreamer` is the fallback for the families without an incremental splitter
(`incremental.py`): each field's text is what the codec's whole parse gives for the ids
so far, held back where more tokens could still change it. `live.py` feeds it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import UpstreamInvalid
from .stream_events import ContentDelta, ReasoningDelta, StreamEvent

__all__ = ["TextStreamer", "think_close_ids"]

_THINK_CLOSE = "</think>"
_FIELDS = (("reasoning_content", ReasoningDelta), ("content", ContentDelta))
_KIND: dict[str, type[ReasoningDelta] | type[ContentDelta]] = dict(_FIELDS)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _settled(text: str, *, tools: bool) -> str:
    """The part of a field's speculative text that more tokens cannot change: without
    a possibly unfinished marker (from the last `<` not closed by `>`; with tools
    offered, from the first `<`, `[` or `{`, where a tool call could start) and without
    trailing whitespace (parsers trim it before a call or at the end)."""
    if tools:
        cut = min((i for i in (text.find(c) for c in "<[{") if i >= 0), default=len(text))
        text = text[:cut]
    else:
        lt = text.rfind("<")
        if lt >= 0 and ">" not in text[lt:]:
            text = text[:lt]
    return text.rstrip()


class TextStreamer:
    """Text deltas of a turn being sampled that are certainly part of its committed
    message: each field's text is what the codec's own parse gives for the ids so far,
    agreed by the parse of the ids plus `</think>` (the model may still close a reasoning
    block, which would turn content so far into reasoning), then `_settled`. What is
    held back is sent by `tail` once the whole message is parsed."""

    def __init__(self, parse: Callable[[Sequence[int]], dict[str, Any]], think_close: Sequence[int],
                 *, tools: bool) -> None:
        self._parse, self._think_close, self._tools = parse, list(think_close), tools
        self.sent: dict[str, str] = {"reasoning_content": "", "content": ""}

    def feed(self, ids: Sequence[int]) -> list[StreamEvent]:
        """The new text deltas once `ids` (all sampled so far) are known."""
        return self.advance(self.settle(ids))

    def settle(self, ids: Sequence[int]) -> dict[str, str]:
        """Each field's text certain for `ids` (pure: the fallback runs it off the loop)."""
        now = self._parse(ids)
        if self._think_close:
            alt = self._parse([*ids, *self._think_close])
        else:  # no what-if: content is certain only after a reasoning block
            alt = now if now.get("reasoning_content") is not None else {**now, "content": ""}
        return {name: _settled(_common_prefix(now.get(name) or "", alt.get(name) or ""), tools=self._tools)
                for name, _ in _FIELDS}

    def advance(self, settled: dict[str, str]) -> list[StreamEvent]:
        """The deltas from what was sent to `settled` (on the loop: it updates `sent`)."""
        events: list[StreamEvent] = []
        for name, kind in _FIELDS:
            safe, done = settled[name], self.sent[name]
            if len(safe) > len(done) and safe.startswith(done):
                events.append(kind(safe[len(done):]))
                self.sent[name] = safe
        return events

    def add(self, name: str, text: str) -> StreamEvent:
        """`text` more of field `name`, from the incremental splitter."""
        self.sent[name] += text
        return _KIND[name](text)

    def tail(self, message: dict[str, Any]) -> list[StreamEvent]:
        """The rest of each field; `UpstreamInvalid` when what was sent is not its prefix."""
        events: list[StreamEvent] = []
        for name, kind in _FIELDS:
            full, done = str(message.get(name) or ""), self.sent[name]
            if not full.startswith(done):
                raise UpstreamInvalid(f"streamed {name} {done[-40:]!r} is not a prefix of the parsed message")
            if len(full) > len(done):
                events.append(kind(full[len(done):]))
        return events


_THINK_CLOSE_IDS: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


def think_close_ids(tokenizer: Any) -> list[int]:
    """`</think>` as ids (the what-if of `TextStreamer`); none when the tokenizer cannot say.
    Encoded once per tokenizer (a server has one): not a tokenizer call per streamed turn."""
    try:
        cached = _THINK_CLOSE_IDS.get(tokenizer)
    except TypeError:  # not weakly referenceable (or unhashable): encode every time
        cached = None
    if cached is None:
        try:
            cached = tuple(int(t) for t in tokenizer.encode(_THINK_CLOSE, add_special_tokens=False))
        except Exception:  # a tokenizer without this signature: no what-if, reasoning is not split live
            cached = ()
        with contextlib.suppress(TypeError):
            _THINK_CLOSE_IDS[tokenizer] = cached
    return list(cached)
