"""Stop strings across the segments of one turn (used by resilient.py).

Both engines match a request's stop strings on its own output text only, never on its
prompt (vLLM's detokenizer checks `output_text` after each step, v1/engine/detokenizer.py;
SGLang's `Req._check_str_based_finish` decodes the output's tail), and SGLang checks its
abort flag before the stop check. A turn cut by a pause and resubmitted as
`prompt + partial` therefore loses its stop strings twice over:

- the step that completed a stop string can come back as `abort`: the kept partial
  already holds the string, and a resubmission samples past it;
- a stop string begun in the kept partial and completed by the resubmitted segment is
  never seen by the engine, whose output starts after its first half.

So the server matches where the engine cannot: on the turn's output text (the kept
partial and the segment, decoded together), the first token after which that text holds
a stop string ends the turn, finish `stop`, `matched_stop` the string (the first in the
request's order, as both engines iterate them). Every id through that token is kept:
both engines keep the ids and trim only the text (SGLang's `no_stop_trim` and vLLM's
`include_stop_str_in_output` are sent anyway), so the committed turn is the
uninterrupted one. A streamed segment is watched as it arrives: nothing past the stop is
shown, and the engine request is aborted there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from session_server.engines.base import GenerateResult
from trajectory.validate import is_int

from .assemble import WeightSpan

__all__ = ["StopStrings", "StreamStops", "cut_at"]

Decode = Callable[[Sequence[Any]], str]


@dataclass(frozen=True)
class StopStrings:
    """The turn's stop strings and how its output ids become text (the server's tokenizer,
    special tokens kept, as the engines are asked: `skip_special_tokens: false`)."""

    stops: tuple[str, ...]
    decode: Decode

    @property
    def window(self) -> int:
        """Ids before a boundary that can hold the start of a stop string crossing it: a
        character takes at most 4 byte-level tokens."""
        return 4 * max(len(s) for s in self.stops) + 8

    def _found(self, ids: Sequence[Any], lo: int, m: int) -> str | None:
        text = self.decode(ids[lo:m])
        return next((s for s in self.stops if s in text), None)

    def first(self, ids: Sequence[Any], since: int) -> tuple[int, str] | None:
        """(m, string): the fewest ids `ids[:m]`, m > `since`, whose text holds a stop
        string, and that string; None when none does. `ids[:since]` hold none (checked
        before), so only a match ending after them counts, and the text is decoded from
        `window` ids before `since` on. O(n log n) decodes of the segment's length."""
        n = len(ids)
        lo = max(0, since - self.window)
        if n <= since or self._found(ids, lo, n) is None:
            return None
        a, b = since + 1, n
        while a < b:  # the text only grows with m: the first m that holds a stop string
            mid = (a + b) // 2
            if self._found(ids, lo, mid) is not None:
                b = mid
            else:
                a = mid + 1
        found = self._found(ids, lo, a)
        assert found is not None
        return a, found

    def in_segment(self, kept: Sequence[Any], seg: Sequence[Any]) -> tuple[int, str] | None:
        """(how many of `seg`'s ids end the turn, the string) when the output `kept + seg`
        completes a stop string in `seg`; None otherwise."""
        tail = list(kept[-self.window:]) if kept else []
        hit = self.first([*tail, *seg], len(tail))
        return None if hit is None else (hit[0] - len(tail), hit[1])


class StreamStops:
    """One resubmitted streamed segment, watched as it arrives: a stop string crossing the
    boundary with the kept partial completes within its first characters, which the
    engine cannot see. Watching ends once the segment's own text is as long as the
    longest stop string (the engine sees any later match itself)."""

    def __init__(self, stops: StopStrings, kept: Sequence[Any]) -> None:
        self._stops = stops
        self._ids: list[Any] = list(kept[-stops.window:])
        self._start = len(self._ids)
        self._longest = max(len(s) for s in stops.stops)
        self.done = False  # matched, or past the boundary: nothing more to watch
        self.matched = False

    def feed(self, ids: Sequence[Any]) -> int | None:
        """How many of `ids` (one delta) the turn keeps when a stop string completes in
        them; None: all of them (no match)."""
        if self.done:
            return None
        at = len(self._ids)
        self._ids.extend(ids)
        hit = self._stops.first(self._ids, at)
        if hit is not None:
            self.done = self.matched = True
            return hit[0] - at
        if len(self._stops.decode(self._ids[self._start:])) >= self._longest:
            self.done = True
        return None


def cut_at(result: GenerateResult, spans: Sequence[WeightSpan], m: int,
           stop: str) -> tuple[GenerateResult, list[WeightSpan]]:
    """The segment as the engine would have ended it at its `m`-th id on `stop`: values cut
    there, finish `stop`. A raw completion count keeps its offset from the ids, so a
    wrong one stays visible to the validator."""
    n = len(result.output_ids)
    ct = result.completion_tokens
    cut = replace(
        result,
        output_ids=list(result.output_ids[:m]),
        logprobs=list(result.logprobs[:m]),
        top_logprobs=None if result.top_logprobs is None else list(result.top_logprobs[:m]),
        output_ids_echo=None if result.output_ids_echo is None else list(result.output_ids_echo[:m]),
        completion_tokens=ct - (n - m) if is_int(ct) else ct,
        finish_reason="stop",
        matched_stop=stop,
        abort_message=None,
    )
    kept = [(s, min(e, m), v) for s, e, v in spans if s < m]
    return cut, kept
