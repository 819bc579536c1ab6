"""A session's live view for the trajectory viewer: its turns as they run.

The viewer (`api/ui_data.py`, `GET /sessions/{sid}/live`) subscribes a callback to
`Session.watchers`; the pipeline tells it when a turn begins (its branch and where its
output will start), each delta a streamed turn samples (ids and logprobs, exactly
what the turn's own stream gets: the engine path is not changed for a watcher), and
when the turn ends, committed or not.

A turn the client does not stream (most RL clients) is streamed from the engine to
the watchers alone while one watches (`Peeker`, asked at each segment's dispatch:
`generate_resilient(peek=...)`): the client still gets one answer at the end, and
nothing a watcher saw counts as shown to the client, so an engine that dies mid-turn
is still re-homed (the watchers get `restart`, then the new engine's tokens). Without
a watcher at a segment's dispatch (a viewer opened mid-segment, a constrained turn, an
engine that cannot stream) that segment's tokens appear when the turn commits (the
viewer reads the tree again on `end`).

Publishing is a few appends to bounded queues on the loop (the subscriber owns the
bound and drops past it): a watcher can never slow or fail a turn. A delta's texts are
decoded once, here, into the event every watcher gets (not once per watcher).

`Session.live_turn` (`LiveTurn`) is the turn in flight as a viewer opening mid-turn
needs it (its branch, where its output starts, its tokens so far): transient like the
watchers, never journaled (nothing in it is committed; a restarted server has no turn
in flight).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trajectory.errors import ValidationError
from trajectory.validate import Expectations, validate_chunk

from ..engines.base import TokenDelta
from ..errors import UpstreamInvalid
from ..sessions import Session

__all__ = ["LiveTurn", "Peeker", "begun", "ended", "observed", "publish", "token_texts"]

log = logging.getLogger(__name__)


def publish(session: Session, event: dict[str, Any]) -> None:
    """`event` to every subscriber of `session`; a subscriber that raises is dropped."""
    for callback in list(session.watchers):
        try:
            callback(event)
        except Exception:  # a viewer's bug must not fail the turn it watches
            log.exception("live watcher of session %s failed; unsubscribed", session.id)
            if callback in session.watchers:
                session.watchers.remove(callback)


MAX_LIVE_TOKENS = 1 << 20  # a turn's tokens kept for a viewer opening mid-turn; past it, `known` goes False


@dataclass
class LiveTurn:
    """The turn in flight, for a viewer that opens during it (`hello`)."""

    branch: int
    output_start: int
    streams: bool
    # compact (12 bytes a token, not ~70 as Python lists): every streamed turn in flight keeps them
    ids: array[int] = field(default_factory=lambda: array("q"))
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    known: bool = True  # `ids` are all of this attempt's tokens so far (False: a segment nobody watched)

    def add(self, ids: Sequence[int], logprobs: Sequence[Any]) -> None:
        if self.known and len(self.ids) + len(ids) > MAX_LIVE_TOKENS:
            self.known = False
            self.restart_arrays()
        if self.known:
            self.ids.extend(ids)
            self.logprobs.extend(float("nan") if v is None else v for v in logprobs)

    def restart_arrays(self) -> None:
        self.ids, self.logprobs = array("q"), array("d")


    def view(self) -> dict[str, Any]:
        """The turn so far, as plain lists (a C-level copy each)."""
        return {"branch": self.branch, "output_start": self.output_start, "streams": self.streams,
                "known": self.known, "ids": self.ids.tolist() if self.known else [],
                "logprobs": self.logprobs.tolist() if self.known else []}


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id's own text, as the live view shows it (a delta is a few ids)."""
    return [str(tokenizer.decode([i], skip_special_tokens=False)) for i in ids]


def begun(session: Session, branch: int, output_start: int, streams: bool) -> None:
    # a streamed turn's tokens are all seen; a non-streamed one's only once a watched segment starts
    session.live_turn = LiveTurn(branch, output_start, streams, known=streams)
    if session.watchers:
        publish(session, {"event": "begin", "branch": branch, "output_start": output_start, "streams": streams})


def ended(session: Session, committed: bool) -> None:
    session.live_turn = None
    if session.watchers:
        publish(session, {"event": "end", "committed": committed})


def _plain(values: Sequence[Any]) -> list[Any]:
    if hasattr(values, "tolist"):  # a numpy array: one C-level conversion
        return list(values.tolist())
    return [v.item() if hasattr(v, "item") else v for v in values]


def _shown(session: Session, tokenizer: Any, ids: list[int], logprobs: list[Any]) -> None:
    """Tokens sampled: kept for a viewer opening later, and published once, texts decoded once."""
    live = session.live_turn
    if isinstance(live, LiveTurn):
        live.add(ids, logprobs)
    if session.watchers:
        publish(session, {"event": "tokens", "ids": ids, "logprobs": logprobs, "texts": token_texts(tokenizer, ids)})


class Peeker:
    """A non-streamed turn's deltas for the watchers only (`generate_resilient`'s `peek`).
    Each is held to the per-token rules here, not by the turn: a bad chunk stops what the
    watchers see and never fails the turn (the segment is sent again unstreamed, and its
    answer judged as an unwatched turn's)."""

    def __init__(self, session: Session, expect: Expectations, tokenizer: Any) -> None:
        self.session, self.expect, self.tokenizer = session, expect, tokenizer
        self.shown = False  # a watcher got tokens of this attempt
        self.broken = False  # a chunk failed the checks: nothing more is shown of this attempt
        self.dispatched = 0  # segments of this attempt dispatched so far

    def __call__(self) -> Callable[[TokenDelta], None] | None:
        """The callback for the segment being dispatched, or None when nobody watches
        (the segment then goes to the engine unstreamed, exactly as before)."""
        live = self.session.live_turn if isinstance(self.session.live_turn, LiveTurn) else None
        first = self.dispatched == 0
        self.dispatched += 1
        if self.session.watchers:
            if first and live is not None:  # watched from the attempt's start: every token is seen
                live.known = True
            return self._publish
        if live is not None:  # this segment's tokens are not seen
            live.known = False
        return None

    def _publish(self, delta: TokenDelta) -> None:
        if self.broken or not self.session.watchers:
            return
        try:
            ids, lps = validate_chunk(delta.ids, delta.logprobs, None, self.expect)
        except ValidationError as exc:
            self.broken = True
            publish(self.session, {"event": "unshown", "reason": str(exc)})
            # an engine whose frames are deltas answers with them joined: the lie would be
            # in the answer, which an unwatched turn never got; stop the stream, and the
            # segment is sent again unstreamed (control/peek.py)
            raise UpstreamInvalid(f"a watched stream's chunk failed the checks: {exc}") from exc
        self.shown = True
        _shown(self.session, self.tokenizer, ids.tolist(), lps.tolist())

    def restart(self, unseen: bool = False) -> None:
        """The turn is re-homed and generated afresh: what the watchers saw is void.
        `unseen`: its segment is being sent again unstreamed (control/peek.py), so the
        attempt's tokens are not all seen even if a later segment is watched."""
        if isinstance(self.session.live_turn, LiveTurn):
            self.session.live_turn.restart_arrays()
            self.session.live_turn.known = False
        self.dispatched = 1 if unseen else 0
        if self.shown and self.session.watchers:
            publish(self.session, {"event": "restart"})
        self.shown = self.broken = False


def observed(session: Session, on_delta: Callable[[TokenDelta], None] | None,
             tokenizer: Any) -> Callable[[TokenDelta], None] | None:
    """The streamed turn's `on_delta`, also publishing each delta to the session's
    watchers (looked up per delta: a viewer that opens mid-turn sees the rest, and
    `live_turn` holds what came before it)."""
    if on_delta is None:
        return None
    forward = on_delta

    def both(delta: TokenDelta) -> None:
        forward(delta)
        _shown(session, tokenizer, _plain(delta.ids), _plain(delta.logprobs))

    return both
