"""Sessions and the session store: state, the in-flight gate, TTL expiry, caps.

A session owns one `TrajectoryTree` and at most one chat turn in flight. The
gate is a *claim*: a unique token taken at the start of a chat and released in a
`finally` by the request that made it, and only by it. Prepare and commit run
under the session's `asyncio.Lock`; readers that serialize in the CPU pool hold
it too, so a concurrent commit never mutates what they read.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trajectory.codec.base import HistoryPolicy
from trajectory.tree import TrajectoryTree

from .errors import OverCapacity, SessionBusy, SessionClosed, SessionNotFound

_log = logging.getLogger("session_server")


class SessionState(enum.Enum):
    ACTIVE = "active"  # accepts chats
    CLOSING = "closing"  # delete requested; an in-flight chat must not commit
    CLOSED = "closed"  # removed from the store


_TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.ACTIVE: frozenset({SessionState.CLOSING, SessionState.CLOSED}),
    SessionState.CLOSING: frozenset({SessionState.CLOSED}),
    SessionState.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    def __init__(self, old: SessionState, new: SessionState) -> None:
        super().__init__(f"illegal session transition {old.value} -> {new.value}")


@dataclass
class SessionConfig:
    """What a client chose at creation (DESIGN.md s4)."""

    ttl_s: float
    metadata: dict[str, Any] = field(default_factory=dict)
    max_context_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    lora: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    history_policy: HistoryPolicy = HistoryPolicy.APPEND


@dataclass
class ControlTotals:
    """Per-session sums of what pauses cost this session's turns (session view)."""

    aborts: int = 0
    resubmits: int = 0
    paused_wait_s: float = 0.0
    version_mismatches: int = 0

    def add(self, result: Any) -> None:
        self.aborts += result.aborts
        self.resubmits += result.resubmits
        self.paused_wait_s += result.paused_wait_s
        self.version_mismatches += result.version_mismatches


@dataclass
class Claim:
    session_id: str
    token: int


class Session:
    def __init__(self, session_id: str, config: SessionConfig, now: float) -> None:
        self.id = session_id
        self.config = config
        self.created_at = now
        self.last_used = now
        self.state = SessionState.ACTIVE
        self.tree = TrajectoryTree()
        self.lock = asyncio.Lock()
        self.inflight: int | None = None  # claim token of the chat in flight
        self.home: str | None = None  # routing target id, set by the router
        self.tools_by_branch: dict[int, Any] = {}  # tools each branch was rendered with
        self.diagnostics: list[dict[str, Any]] = []  # TITO mismatches, repairs, forks
        self.turns_discarded = 0  # turns ended without a commit: client gone, deleted mid-turn
        self.turn: asyncio.Task[Any] | None = None  # the in-flight turn's work; a DELETE cancels it
        self.control_totals = ControlTotals()
        self.token = secrets.token_urlsafe(32)  # the agent's api_key; checked by auth.py when auth is on

    def transition(self, new: SessionState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(self.state, new)
        self.state = new

    def note(self, kind: str, **info: Any) -> None:
        """Record a diagnostic visible in the session view (bounded)."""
        if len(self.diagnostics) < 256:
            self.diagnostics.append({"kind": kind, "at": time.time(), **info})


class SessionStore:
    """All sessions of this process. Every method is synchronous (loop-atomic)."""

    def __init__(
        self,
        *,
        max_sessions: int = 100_000,
        default_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.default_ttl_s = default_ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._claims = itertools.count(1)
        # called once per session as it leaves the store (DELETE, TTL, a deferred close):
        # the app forgets the session's routing state here, so no per-session table leaks
        self.on_remove: list[Callable[[Session], None]] = []

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, config: SessionConfig) -> Session:
        if len(self._sessions) >= self.max_sessions:
            raise OverCapacity(f"session cap reached ({self.max_sessions})")
        sid = secrets.token_hex(16)  # 128 bits: unguessable
        session = Session(sid, config, self._clock())
        self._sessions[sid] = session
        return session

    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None or s.state is not SessionState.ACTIVE:
            raise SessionNotFound(f"unknown session {session_id!r}")
        return s

    def touch(self, session: Session) -> None:
        """A read of the session (view, trajectory) counts as use: it pushes back its TTL."""
        session.last_used = self._clock()

    def claim(self, session_id: str) -> tuple[Session, Claim]:
        """Take the in-flight gate. Closing beats busy (404 before 409)."""
        s = self.get(session_id)
        if s.inflight is not None:
            raise SessionBusy(f"a chat is already in flight on session {session_id}")
        token = next(self._claims)  # only needs to be unique in this process
        s.inflight = token
        s.last_used = self._clock()
        return s, Claim(session_id, token)

    def release(self, session: Session, claim: Claim) -> None:
        """Release only the claim this request made; finish a pending close."""
        if session.inflight == claim.token:
            session.inflight = None
            session.last_used = self._clock()
            if session.state is SessionState.CLOSING:
                self._remove(session)

    def ensure_can_commit(self, session: Session, claim: Claim) -> None:
        """At commit time: the session must still be active and the claim ours."""
        if session.state is not SessionState.ACTIVE:
            raise SessionClosed(f"session {session.id} was closed during the turn; nothing committed")
        if session.inflight != claim.token:
            raise SessionClosed(f"session {session.id} claim lost; nothing committed")

    def close(self, session_id: str) -> Session:
        """Delete: immediate when idle. With a chat in flight the session is closing: its
        turn is cancelled (which aborts the engine request, and the turn answers 409
        session_closed) and the removal completes at that turn's release."""
        s = self.get(session_id)
        if s.inflight is None:
            self._remove(s)
        else:
            s.transition(SessionState.CLOSING)
            if s.turn is not None:
                s.turn.cancel()
        return s

    def _remove(self, s: Session) -> None:
        """The one removal path: every way out of the store ends here, hooks included."""
        s.transition(SessionState.CLOSED)
        self._sessions.pop(s.id, None)
        for hook in self.on_remove:
            try:
                hook(s)
            except Exception:  # a hook never keeps a session in the store
                _log.exception("on_remove hook failed for session %s", s.id)

    def expire(self) -> list[str]:
        """Remove idle sessions past their TTL; never one with a chat in flight."""
        now = self._clock()
        expired = [
            s for s in self._sessions.values()
            if s.inflight is None and now - s.last_used > s.config.ttl_s
        ]
        for s in expired:
            self._remove(s)
        return [s.id for s in expired]

    def all(self) -> Mapping[str, Session]:
        return self._sessions
