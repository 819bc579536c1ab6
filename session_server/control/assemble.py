"""Segments into one turn: the accumulator of aborted segments' raw values and the
`ResilientResult` that looks like one uninterrupted generation (used by resilient.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from session_server.engines.base import FinishReason, GenerateRequest, GenerateResult
from session_server.routed import Piece, Unrequested
from trajectory.validate import is_int

__all__ = ["Acc", "Counts", "ResilientResult", "WeightSpan", "assemble"]

WeightSpan = tuple[int, int, Any]


@dataclass(frozen=True)
class ResilientResult(GenerateResult):
    """One turn's engine output across any number of aborted segments.

    The inherited fields look like one uninterrupted `GenerateResult` (request id
    of the turn, prompt_tokens of the original prompt, concatenated raw ids and
    logprobs), so `validate_generation` takes it as is."""

    weight_spans: tuple[WeightSpan, ...] = ()  # relative to the sampled ids
    segments: int = 1
    segment_request_ids: tuple[str, ...] = ()
    segment_seeds: tuple[int | None, ...] = ()  # the seed each segment was sent (None: none)
    aborts: int = 0
    empty_aborts: int = 0
    resubmits: int = 0
    paused_wait_s: float = 0.0
    version_mismatches: int = 0
    dropped_tokens: int = 0  # constrained partials discarded and regenerated (never committed)
    # routing replay: each kept segment's raw routed experts and the positions they cover
    # (decoded and gap-checked off the loop by session_server.routed.join)
    routed_pieces: tuple[Piece, ...] = ()
    stale_bound: dict[str, Any] | None = None  # ended at an update by max_weight_lag (control/lag.py)
    # how the engine that ran it reports sampling support (`EngineCapabilities.support_logprobs`)
    support_rule: str | None = None
    # where each segment's kept ids lie in the output and how it ended (`Counts.mark`)
    segment_marks: tuple[dict[str, Any], ...] = ()

    def counters(self) -> dict[str, Any]:
        """Per-turn control counters, for the session view."""
        return {
            "segments": self.segments,
            "aborts": self.aborts,
            "empty_aborts": self.empty_aborts,
            "resubmits": self.resubmits,
            "paused_wait_s": self.paused_wait_s,
            "version_mismatches": self.version_mismatches,
            "dropped_tokens": self.dropped_tokens,
        }


def _as_list(v: Sequence[Any] | None) -> list[Any] | None:
    return v if v is None or isinstance(v, list) else list(v)


@dataclass
class Acc:
    """The turn so far: raw values of the segments that produced tokens."""

    ids: list[Any] = field(default_factory=list)
    lps: list[Any] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    echo: list[Any] = field(default_factory=list)
    tops_ok: bool = True  # every segment with tokens had top logprobs
    echo_ok: bool = True  # every segment with tokens had an id echo
    spans: list[list[Any]] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)  # routing replay, one per kept segment

    def routed_start(self, request: GenerateRequest) -> int:
        """Where the next segment's routed-experts rows start: after the rows held."""
        return self.pieces[-1].end if self.pieces else request.routed_experts_start

    def add_routed(self, request: GenerateRequest, result: GenerateResult, prompt_len: int,
                   sampled: int | None = None) -> None:
        """Keep a segment's routed experts (when the turn asked for them); `sampled`: the
        ids the engine's rows cover when the turn kept fewer (cut at a stop string)."""
        if request.return_routed_experts:
            raw = result.routed_experts
            assert not isinstance(raw, Unrequested), "a payload asked for is never dropped at parse"
            self.pieces.append(Piece(raw, prompt_len, len(result.output_ids), self.routed_start(request), sampled))

    def add(self, result: GenerateResult, spans: Sequence[WeightSpan]) -> None:
        """Append a segment's raw values and its stamped version spans (relative to it)."""
        n = len(result.output_ids)
        if n == 0:
            return
        start = len(self.ids)
        self.ids.extend(result.output_ids)
        self.lps.extend(result.logprobs)
        if result.top_logprobs is None:
            self.tops_ok = False
        else:
            self.tops.extend(result.top_logprobs)
        if result.output_ids_echo is None:
            self.echo_ok = False
        else:
            self.echo.extend(result.output_ids_echo)
        for s, e, version in spans:
            last = self.spans[-1] if self.spans else None
            if last is not None and last[2] == version and last[1] == start + s:
                last[1] = start + e  # consecutive equal versions merge
            else:
                self.spans.append([start + s, start + e, version])


@dataclass
class Counts:
    aborts: int = 0
    empty_aborts: int = 0
    resubmits: int = 0
    mismatches: int = 0
    dropped_tokens: int = 0  # partials of constrained segments, regenerated from the prompt
    paused_wait_s: float = 0.0
    rids: list[str] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)  # the seed each segment was sent
    marks: list[dict[str, Any]] = field(default_factory=list)  # one per settled segment

    def mark(self, start: int, kept: int, ended: str, dropped: int = 0) -> None:
        """Record the last dispatched segment: its `kept` ids are output `[start, end)` (an
        abort's end is where the resubmission starts: the exact abort point), `ended` the
        engine's finish (`abort`, `stop`, `length`), `dropped` the ids of a constrained
        partial that were discarded. Only this tells a reader where a pause cut a turn
        that no weight update split."""
        mark = {"start": start, "end": start + kept, "ended": ended, "request_id": self.rids[-1]}
        self.marks.append({**mark, "dropped": dropped} if dropped else mark)


def assemble(
    request: GenerateRequest,
    first: GenerateResult,
    final: GenerateResult | None,
    final_spans: Sequence[WeightSpan],
    acc: Acc,
    counts: Counts,
    ended: FinishReason = "length",
) -> ResilientResult:
    """One GenerateResult for the whole turn. The final segment's counters stay raw
    (offset by the accumulated tokens) so the caller's validator still sees bad values.
    Without a `final` segment the turn `ended` with the accumulated tokens: `length` (the
    budget ran out across aborts) or `abort` (its staleness bound, control/lag.py)."""
    before = len(acc.ids)
    single = len(counts.rids) == 1
    if final is not None:
        acc.add(final, final_spans)
        ct, pt = final.completion_tokens, final.prompt_tokens
        completion = before + ct if is_int(ct) else ct
        prompt_tokens = pt - before if is_int(pt) else pt
        finish, matched = final.finish_reason, final.matched_stop
        weight_version = None  # the stamped spans' last version, below
        routed = final.routed_experts  # covers prompt + every partial: the last segment's is whole
        abort_message = final.abort_message
        echoed_rid = final.request_id
        raw_tops, raw_echo = final.top_logprobs, final.output_ids_echo
    else:  # budget exhausted by aborts, or the staleness bound reached
        completion, prompt_tokens = before, first.prompt_tokens
        finish, matched, weight_version, routed, abort_message = ended, None, None, None, None
        echoed_rid = counts.rids[-1]
        raw_tops, raw_echo = [], []
    if weight_version is None and acc.spans:
        weight_version = acc.spans[-1][2]
    if acc.ids:
        tops = acc.tops if acc.tops_ok else None
        echo = acc.echo if acc.echo_ok else None
    else:  # no token at all: keep the engine's own (empty) shapes
        tops, echo = _as_list(raw_tops), _as_list(raw_echo)
    # the turn answers to its original id, but a wrong echo of the last segment's id stays visible
    rid = request.request_id if echoed_rid == counts.rids[-1] else echoed_rid
    return ResilientResult(
        request_id=first.request_id if single else rid,
        output_ids=acc.ids,
        logprobs=acc.lps,
        finish_reason=finish,
        matched_stop=matched,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        cached_tokens=first.cached_tokens,
        weight_version=weight_version,
        output_ids_echo=echo,
        top_logprobs=tops,
        routed_experts=routed,
        abort_message=abort_message,
        weight_spans=tuple((int(s), int(e), v) for s, e, v in acc.spans),
        segments=len(counts.rids),
        segment_request_ids=tuple(counts.rids),
        segment_seeds=tuple(counts.seeds),
        aborts=counts.aborts,
        empty_aborts=counts.empty_aborts,
        resubmits=counts.resubmits,
        paused_wait_s=counts.paused_wait_s,
        version_mismatches=counts.mismatches,
        dropped_tokens=counts.dropped_tokens,
        routed_pieces=tuple(acc.pieces),
        segment_marks=tuple(counts.marks),
    )
