"""Which weight version sampled each token: the trainer's word, refined by the engine's.

The trainer's version (`POST /control/weight_version`) is the truth the server stamps;
the plane pushes it to every engine that takes one (vLLM and SGLang
`POST /update_weight_version`), so an engine that reports versions reports the
trainer's. What an engine reports only refines where the server cannot know:

- vLLM 0.32 reports per-token spans (`choices[].weight_versions`), exact across a
  `keep` pause: a request frozen under version 7 and resumed under 8 comes back as
  two spans, split where the update landed.
- SGLang reports one version per request, read when it finishes
  (`meta_info.weight_version`): a `keep` segment frozen across an update is stamped
  with the new version whole.
- An engine that reports nothing (older vLLM): every token of a segment is stamped
  with the trainer's version at the segment's dispatch.
- A streamed segment (either engine, when it reports no per-token spans) is split where
  the server saw the update take effect (`ReceivedSplit`): the tokens it had received
  when the engines resumed from the pause in which the version was set (or, set while
  running, when it was set) were sampled with the old weights, the rest with the new.
  A frozen `keep` segment on SGLang is then exact, not stamped new whole.

A reported version is taken only when it is one the trainer went through while the
segment ran: an int-like version in [dispatch, current]. An engine's unset version
(`"default"`, what SGLang and vLLM report until told otherwise) never overrides the
trainer's; neither does a stale or foreign one, which is counted as a mismatch and
stamped with the dispatch version. With no trainer version at all, the engine's own
version is kept as it reports it (int-like strings as ints), its unset marker as None.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from trajectory.errors import ValidationError
from trajectory.validate import is_int

from .plane import ControlPlane

__all__ = ["UNSET_VERSIONS", "ReceivedSplit", "SegmentSpans", "received_split", "reports_per_token",
           "resolve_version", "segment_spans"]

# what SGLang (`server_args.weight_version`) and vLLM (`/weight_info`) report until a
# version is set (both default to "default"); an empty or null version means the same
UNSET_VERSIONS = frozenset({"default", ""})

SegmentSpans = list[tuple[int, int, Any]]


_INT = re.compile(r"-?[0-9]+")


def _as_int(v: Any) -> int | None:
    if is_int(v):
        return int(v)
    if isinstance(v, str) and _INT.fullmatch(v.strip()):
        return int(v.strip())
    return None


def _check_type(reported: Any) -> None:
    """A version is a string or a finite number; anything else is bad engine output."""
    if isinstance(reported, str) or is_int(reported):
        return
    if isinstance(reported, float) and math.isfinite(reported):
        return
    raise ValidationError("weight_version", f"must be a str or finite number, got {reported!r}")


def _went_through(v: int, dispatch: int | None, current: int | None) -> bool:
    """Whether the trainer's version was `v` at some time while the segment ran."""
    if dispatch is None:  # the first version came while the segment ran: only that one
        return v == current
    if current is None or current >= dispatch:
        return dispatch <= v <= (current if current is not None else dispatch)
    return v in (dispatch, current)  # forced back (`force: true`): the two it saw


def _unset(reported: Any) -> bool:
    return reported is None or (isinstance(reported, str) and reported.strip() in UNSET_VERSIONS)


def reports_per_token(spans: Sequence[Any] | None) -> bool:
    """Whether an engine's per-token spans say anything: vLLM without dev mode reports
    spans of its unset `"default"` only (a malformed span counts: it is rejected later)."""
    return any(not (isinstance(sp, tuple | list) and len(sp) == 3 and _unset(sp[2])) for sp in spans or ())


def resolve_version(reported: Any, dispatch: int | None, current: int | None) -> tuple[Any, bool]:
    """(the version to stamp, whether `reported` disagreed with the trainer).

    `dispatch` is the trainer's version when the segment was sent, `current` now.
    Raises `ValidationError` for a version that is neither a string nor a number."""
    unset = _unset(reported)
    if not unset:
        _check_type(reported)
    if current is None and dispatch is None:  # no trainer version: the engine's is all there is
        if unset:
            return None, False
        as_int = _as_int(reported)
        return (as_int if as_int is not None else reported), False
    if unset:
        return dispatch, False
    v = _as_int(reported)
    if v is not None and _went_through(v, dispatch, current):
        return v, False
    return dispatch, True


def _checked_spans(raw: Sequence[Any], n: int) -> list[tuple[int, int, Any]]:
    """Engine spans must tile [0, n) in order; anything else is bad engine output."""
    out: list[tuple[int, int, Any]] = []
    at = 0
    for i, span in enumerate(raw):
        try:
            start, end, version = span
        except (TypeError, ValueError):
            raise ValidationError("weight_versions", f"entry {i} is not (start, end, version): {span!r}") from None
        if not (is_int(start) and is_int(end)) or start != at or end <= start or end > n:
            raise ValidationError("weight_versions", f"entry {i} {span!r} does not continue [0, {n}) at {at}")
        out.append((int(start), int(end), version))
        at = int(end)
    if at != n:
        raise ValidationError("weight_versions", f"spans end at {at}, not at the {n} output ids")
    return out


def segment_spans(
    n: int, reported: Any, reported_spans: Sequence[Any] | None, dispatch: int | None, current: int | None,
) -> tuple[SegmentSpans, int]:
    """The stamped (start, end, version) spans of one segment's `n` output ids, relative
    to it, and how many reported versions disagreed with the trainer's. Per-token spans
    win over the one reported version; equal neighbours merge."""
    if n == 0:
        return [], 0
    raw = list(reported_spans) if reported_spans is not None else [(0, n, reported)]
    spans: SegmentSpans = []
    mismatches = 0
    for start, end, version in _checked_spans(raw, n):
        stamped, mismatch = resolve_version(version, dispatch, current)
        mismatches += mismatch
        if spans and spans[-1][2] == stamped:
            spans[-1] = (spans[-1][0], end, stamped)
        else:
            spans.append((start, end, stamped))
    return spans, mismatches


@dataclass
class ReceivedSplit:
    """One streamed segment's tokens against the trainer's updates, as they arrive: the
    split the server itself knows where the engine reports one version per request (SGLang,
    read at its end) or none. Weights change only while the engines are paused (the
    documented order: pause, update, set the version, resume), and a `keep` pause freezes
    sampling, so every token received before the engines resumed was sampled with the
    old weights; a version set while running takes effect when it is set."""

    received: int = 0
    marks: list[tuple[int, Any]] = field(default_factory=list)  # (tokens received before, version from there)
    pending: Any = None  # set while paused: effective at the resume

    def on_version(self, version: Any, paused: bool) -> None:
        if paused:
            self.pending = version
        else:
            self.marks.append((self.received, version))

    def on_resume(self) -> None:
        if self.pending is not None:
            self.marks.append((self.received, self.pending))
            self.pending = None

    def spans(self, n: int, dispatch: Any) -> SegmentSpans | None:
        """The segment's `n` ids stamped by the updates that took effect while it ran
        (None: none did); a version set while paused that never took effect (the segment
        ended first) leaves every token with its dispatch version."""
        if not self.marks or n == 0:
            return None
        spans: SegmentSpans = []
        at, version = 0, dispatch
        for count, nxt in [*self.marks, (n, None)]:
            end = min(count, n)
            if end > at:
                if spans and spans[-1][2] == version:
                    spans[-1] = (spans[-1][0], end, version)
                else:
                    spans.append((at, end, version))
                at = end
            version = nxt
        return spans


@contextmanager
def received_split(control: ControlPlane, streamed: bool) -> Iterator[ReceivedSplit | None]:
    """While a streamed segment runs: its `ReceivedSplit`, told of every new version and of
    the engines' resume (None for a segment that is not streamed: nothing is known)."""
    if not streamed:
        yield None
        return
    split = ReceivedSplit()

    def on_version(version: int) -> None:
        split.on_version(version, control.blocked())

    control.on_weight_version.append(on_version)
    control.on_resume.append(split.on_resume)
    try:
        yield split
    finally:
        control.on_weight_version.remove(on_version)
        control.on_resume.remove(split.on_resume)
