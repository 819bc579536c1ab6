"""A session's live view for the trajectory viewer: its turns as they run.

The viewer (`api/ui_data.py`, `GET /sessions/{sid}/live`) subscribes a callback to
`Session.watchers`; the pipeline tells it when a turn begins (its branch and where its
output will start), each delta a streamed turn samples (ids and logprobs, exactly
what the turn's own stream gets: the engine path is not changed for a watcher), and
when the turn ends, committed or not. A turn that is not streamed sends no deltas: it
shows as in flight, and its tokens appear when it commits (the viewer reads the tree
again on `end`).

Publishing is a few appends to bounded queues on the loop (the subscriber owns the
bound and drops past it): a watcher can never slow or fail a turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..engines.base import TokenDelta
from ..sessions import Session

__all__ = ["begun", "ended", "observed", "publish"]

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


def begun(session: Session, branch: int, output_start: int, streams: bool) -> None:
    if session.watchers:
        publish(session, {"event": "begin", "branch": branch, "output_start": output_start, "streams": streams})


def ended(session: Session, committed: bool) -> None:
    if session.watchers:
        publish(session, {"event": "end", "committed": committed})


def _plain(values: Sequence[Any]) -> list[Any]:
    return [v.item() if hasattr(v, "item") else v for v in values]


def observed(session: Session, on_delta: Callable[[TokenDelta], None] | None) -> Callable[[TokenDelta], None] | None:
    """The streamed turn's `on_delta`, also publishing each delta to the session's
    watchers (looked up per delta: a viewer that opens mid-turn sees the rest)."""
    if on_delta is None:
        return None
    forward = on_delta

    def both(delta: TokenDelta) -> None:
        forward(delta)
        if session.watchers:
            publish(session, {"event": "tokens", "ids": _plain(delta.ids), "logprobs": _plain(delta.logprobs)})

    return both
