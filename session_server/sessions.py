"""Sessions and the session store: state, the in-flight gate, TTL expiry, caps.

A session owns one `TrajectoryTree` and at most one chat turn in flight. The
gate is a *claim*: a unique token taken at the start of a chat and released in a
`finally` by the request that made it, and only by it. A chat that finds the gate
taken may queue for it (`wait_claim`): the release hands the claim straight to the
oldest waiter, so turns on one session still run, and commit, one at a time and in
arrival order, and no new request overtakes a queued one. Prepare and commit run
under the session's `asyncio.Lock`; readers that serialize on the CPU offload threads hold
it too, so a concurrent commit never mutates what they read.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import heapq
import itertools
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from trajectory.codec.base import HistoryPolicy
from trajectory.tree import TrajectoryTree

from .errors import (
    OverCapacity,
    Recovering,
    SessionBusy,
    SessionClosed,
    SessionNotFound,
    WrongInstance,
    shown,
)

_log = logging.getLogger("session_server")

MAX_DIAGNOSTICS = 256  # per session, the newest kept (Session.note)

ID_SEPARATOR = "."
"""Between the instance id and the random part of a session id (`{instance}.{32 hex}`):
instance ids are `[a-z0-9-]` (settings.py), so the first dot ends the instance, and a
proxy routes a session's requests by that prefix of the path alone."""


# no '.', the separator in session ids; DNS-label-like so a pod name fits (settings.py checks it)
INSTANCE_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,30}[a-z0-9])?")


def instance_of(session_id: str) -> str | None:
    """The instance a session id names (None: no prefix, or one no instance can have)."""
    instance, sep, _ = session_id.partition(ID_SEPARATOR)
    return instance if sep and INSTANCE_ID.fullmatch(instance) else None


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


SAMPLING_POLICIES = ("pinned", "client")
"""Whose sampling values reach the engine (docs/api.md "Sampling policy"): `pinned`, the
session's (a harness's own temperature on a side request is recorded, never sent);
`client`, the request's, each falling back to the session's."""


@dataclass
class SessionConfig:
    """What a client chose at creation."""

    ttl_s: float
    metadata: dict[str, Any] = field(default_factory=dict)
    max_context_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    lora: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    history_policy: HistoryPolicy = HistoryPolicy.APPEND
    routing_replay: bool = False  # ask the engine for routed experts and store them (R3)
    max_weight_lag: int | None = None  # weight versions a turn may span; None: unbounded
    # whose sampling values reach the engine: "pinned" (the session's) or "client" (the
    # request's over the session's defaults); resolved at creation against the server's
    sampling_policy: str = "client"
    seed: int | None = None  # each engine request's seed derives from it (engines/base.py: derive_seed)
    sampling_support: int | None = None  # k: capture each token's sampling support (turn/support_rules.py)


@dataclass
class ControlTotals:
    """Per-session sums of what pauses cost this session's turns (session view)."""

    aborts: int = 0
    resubmits: int = 0
    paused_wait_s: float = 0.0
    version_mismatches: int = 0
    dropped_tokens: int = 0  # constrained partials regenerated after a pause
    ended_stale: int = 0  # turns ended at an update by max_weight_lag

    def add(self, result: Any) -> None:
        self.aborts += result.aborts
        self.resubmits += result.resubmits
        self.paused_wait_s += result.paused_wait_s
        self.version_mismatches += result.version_mismatches
        self.dropped_tokens += getattr(result, "dropped_tokens", 0)
        self.ended_stale += getattr(result, "stale_bound", None) is not None


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
        # TITO mismatches, repairs, forks: the newest MAX_DIAGNOSTICS (what explains the
        # session's present state), the older ones counted
        self.diagnostics: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_DIAGNOSTICS)
        self.diagnostics_dropped = 0
        self.turns_discarded = 0  # turns ended without a commit: client gone, deleted mid-turn
        # commit order (TurnRecord.seq) of turns whose answers a later committed request's
        # history held (prepare.Prepared.answered): `built_on` for replays; one int per turn
        self.answered_seqs: set[int] = set()
        self.turn: asyncio.Task[Any] | None = None  # the in-flight turn's work; a DELETE cancels it
        # chats queued for the claim, oldest first (non-empty only while a turn is in flight)
        self.waiters: collections.deque[asyncio.Future[Claim]] = collections.deque()
        self.control_totals = ControlTotals()
        self.token = secrets.token_urlsafe(32)  # the agent's api_key; checked by auth.py when auth is on
        # set after the episode by POST /sessions/{sid}/reward, carried into every sample (samples_api.py)
        self.reward: float | None = None
        self.leaf_rewards: dict[int, float] = {}  # per-leaf rewards, overriding `reward`
        self.turn_rewards: dict[int, float] = {}  # per-turn (process) rewards by the turn's seq
        self.reward_metadata: dict[str, Any] = {}  # merged over config.metadata
        # Responses API: response id -> its turn's place in the tree (api/dialects/openai_responses.py)
        self.responses: dict[str, Any] = {}
        self.journaled_use = now  # the store's clock at the last `touch` the journal kept
        self.gone_reason = ""  # why it left the store (closed, expired, taken by samples close): a tombstone's words
        # the viewer's live subscribers (turn/watch.py): transient, never journaled (they hold no
        # committed state: a restarted server's viewer reconnects and reads the tree)
        self.watchers: list[Callable[[dict[str, Any]], None]] = []
        self.live_turn: Any = None  # the turn in flight as a viewer sees it (turn/watch.py `LiveTurn`), transient too

    def built_on(self, turn: tuple[int, int]) -> bool:
        """Whether a committed turn extends `turn` (branch id, turn index): its client must
        have had that turn's response (idempotency.py: a retry is never of such a turn).
        A request that held its answer is recorded at its commit (`answered_seqs`, also
        when it forked away from the turn's record); forks share their prefix's turn
        records by reference, so one identity test per branch finds the turns that
        extend it. O(branches); run for retries only."""
        branch_id, index = turn
        try:
            record = self.tree.get(branch_id).trajectory.turn(index)
        except (LookupError, IndexError):
            return False
        if record.seq in self.answered_seqs:  # a later request's history held its answer
            return True  # (also when that request forked: its branch may not hold the record)
        return any(t.num_turns > index + 1 and t.turn(index) is record
                   for t in (b.trajectory for b in self.tree.branches()))

    def transition(self, new: SessionState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(self.state, new)
        self.state = new

    def note(self, kind: str, **info: Any) -> None:
        """Record a diagnostic visible in the session view. Bounded, keeping the newest: a
        long session's latest fork or repair is the one to explain, and the oldest are
        dropped and counted (`diagnostics_dropped`)."""
        if len(self.diagnostics) == MAX_DIAGNOSTICS:
            self.diagnostics_dropped += 1
        self.diagnostics.append({"kind": kind, "at": time.time(), **info})


def _deadline(s: Session) -> float:
    """When `s` expires if nothing uses it again: the one expiry rule (sweep and tests)."""
    return s.last_used + s.config.ttl_s


class SessionStore:
    """All sessions of this process. Every method is synchronous (loop-atomic).

    TTL expiry keeps a min-heap of ``(deadline, session_id)`` so that a sweep
    costs O(due · log n), not a scan of every session (a scan of 100K sessions
    held the loop ~30-50 ms every sweep). Invariant: every session in
    the store has exactly one heap entry, and its key is a *lower bound* of the
    session's real deadline (`_deadline`). Using a session (claim, release, or a
    read that refreshes `last_used`) therefore only sets `last_used`: when its
    entry comes due the sweep finds the real deadline later and re-pushes it.
    A removed session leaves a stale entry behind (skipped when popped); when
    stale entries outnumber live ones the heap is rebuilt, so it never holds
    more than ~2 entries per live session.
    """

    def __init__(
        self,
        *,
        max_sessions: int = 100_000,
        default_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        instance_id: str | None = None,
        clustered: bool = False,
    ) -> None:
        self.instance_id = instance_id  # prefix of every session id made here (None: bare ids)
        # other instances exist (peers are configured): only then may an unknown id be theirs
        self.clustered = clustered
        self.max_sessions = max_sessions
        self.default_ttl_s = default_ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._expiry: list[tuple[float, str]] = []  # min-heap of (deadline lower bound, id)
        self._claims = itertools.count(1)
        # called once per session as it leaves the store (DELETE, TTL, a deferred close):
        # the app forgets the session's routing state here, so no per-session table leaks
        self.on_remove: list[Callable[[Session], None]] = []
        # the journal's replay runs (start-up): every session answers 503 recovering until it is done
        self.recovering = False
        # raises SessionGone for an id the journal holds a tombstone of (None: no journal)
        self.check_gone: Callable[[str], None] | None = None
        # a read that pushed a session's TTL back (`touch`): the journal keeps the latest (None: no journal)
        self.on_touch: Callable[[Session], None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, config: SessionConfig) -> Session:
        if self.recovering:
            raise Recovering("this instance is replaying its session journal; retry in a moment")
        if len(self._sessions) >= self.max_sessions:
            raise OverCapacity(f"session cap reached ({self.max_sessions})")
        sid = secrets.token_hex(16)  # 128 bits: unguessable
        if self.instance_id is not None:
            sid = f"{self.instance_id}{ID_SEPARATOR}{sid}"
        session = Session(sid, config, self._clock())
        self._sessions[sid] = session
        heapq.heappush(self._expiry, (_deadline(session), sid))
        return session

    def discard(self, session: Session) -> None:
        """Take back a session just created whose creation could not be stored (no hook
        runs: nothing ever saw it)."""
        self._sessions.pop(session.id, None)
        session.state = SessionState.CLOSED

    def clock(self) -> float:
        """The store's clock (monotonic): what `last_used` and TTL deadlines are read on."""
        return self._clock()

    def restore(self, session: Session) -> None:
        """Put back a session rebuilt from the journal (recovery), with its id, times and
        TTL as they were; the cap is not applied (it held them before the restart)."""
        self._sessions[session.id] = session
        heapq.heappush(self._expiry, (_deadline(session), session.id))

    def get(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None or s.state is not SessionState.ACTIVE:
            self._raise_missing(session_id)
        return s

    def _raise_missing(self, session_id: str) -> NoReturn:
        """404, or 421 when the id names another instance of this cluster: a proxy sent it
        to the wrong one (only the miss path pays for the check). A server without peers
        has no other instance to route to: any unknown id, whatever its prefix, is a 404
        (a made-up id must not send the client looking for an "instance 0"). While the
        journal replays, 503 (the session may come back); a tombstone's id, 410."""
        if self.recovering:
            raise Recovering(f"this instance is replaying its session journal; session {shown(session_id)} "
                             "may come back in a moment")
        if self.check_gone is not None:
            self.check_gone(session_id)
        owner = instance_of(session_id)
        if owner is not None and self.clustered and self.instance_id is not None and owner != self.instance_id:
            raise WrongInstance(f"session {shown(session_id)} belongs to instance {owner!r}, not to this one "
                                f"({self.instance_id!r}): route /sessions/{owner}{ID_SEPARATOR}... to instance {owner}")
        raise SessionNotFound(f"unknown session {shown(session_id)}")

    def touch(self, session: Session) -> None:
        """A read of the session (view, trajectory) counts as use: it pushes back its TTL."""
        session.last_used = self._clock()
        if self.on_touch is not None:
            self.on_touch(session)

    def claim(self, session_id: str) -> tuple[Session, Claim]:
        """Take the in-flight gate. Closing beats busy (404 before 409)."""
        s = self.get(session_id)
        if s.inflight is not None:
            raise SessionBusy(f"a chat is already in flight on session {session_id}")
        return s, self._take(s)

    def _take(self, s: Session) -> Claim:
        token = next(self._claims)  # only needs to be unique in this process
        s.inflight = token
        s.last_used = self._clock()
        return Claim(s.id, token)

    def wait_claim(self, session: Session) -> asyncio.Future[Claim]:
        """Queue for the gate of a busy session: the future gets the claim when every
        turn before it is over (`release` hands it over), or `SessionClosed` when the
        session is deleted first. A waiter that gives up cancels its future; one that
        got a claim it no longer wants must `release` it."""
        fut: asyncio.Future[Claim] = asyncio.get_running_loop().create_future()
        session.waiters.append(fut)
        return fut

    def release(self, session: Session, claim: Claim) -> None:
        """Release only the claim this request made: to the oldest live waiter, else
        free; finish a pending close (its waiters were failed by `close`)."""
        if session.inflight == claim.token:
            session.inflight = None
            session.last_used = self._clock()
            if session.state is SessionState.CLOSING:
                self._remove(session)
                return
            while session.waiters:
                fut = session.waiters.popleft()
                if not fut.done():  # else it gave up (timed out, its client left)
                    fut.set_result(self._take(session))
                    return

    def ensure_can_commit(self, session: Session, claim: Claim) -> None:
        """At commit time: the session must still be active and the claim ours."""
        if session.state is not SessionState.ACTIVE:
            raise SessionClosed(f"session {session.id} was closed during the turn; nothing committed")
        if session.inflight != claim.token:
            raise SessionClosed(f"session {session.id} claim lost; nothing committed")

    def close(self, session_id: str, reason: str = "closed by DELETE") -> Session:
        """Delete: immediate when idle. With a chat in flight the session is closing: its
        turn is cancelled (which aborts the engine request, and the turn answers 409
        session_closed) and the removal completes at that turn's release."""
        s = self.get(session_id)
        s.gone_reason = reason
        if s.inflight is None:
            self._remove(s)
        else:
            s.transition(SessionState.CLOSING)
            if s.turn is not None:
                s.turn.cancel()
            while s.waiters:
                fut = s.waiters.popleft()
                if not fut.done():
                    fut.set_exception(SessionClosed(
                        f"session {session_id} was deleted while this chat waited for the turn in flight"))
        return s

    def _remove(self, s: Session) -> None:
        """The one removal path (delete, deferred close, expiry): every way out of the
        store ends here, hooks included."""
        s.transition(SessionState.CLOSED)
        self._sessions.pop(s.id, None)
        if len(self._expiry) > 2 * len(self._sessions):
            self._compact()
        for hook in self.on_remove:
            try:
                hook(s)
            except Exception:  # a hook never keeps a session in the store
                _log.exception("on_remove hook failed for session %s", s.id)

    def _compact(self) -> None:
        """Drop the entries of removed sessions (stale entries outnumber live ones).

        O(n), paid at most once per n removals; rebuilt in place so a sweep that
        is popping the heap keeps working on the same list."""
        live = self._sessions
        self._expiry[:] = [e for e in self._expiry if e[1] in live]
        heapq.heapify(self._expiry)

    def expire(self, *, limit: int | None = None) -> list[str]:
        """Remove idle sessions past their TTL; never one with a chat in flight.

        Pops only entries whose key is due: a removed session's entry is dropped,
        a session used since its entry was pushed is re-pushed at its real
        deadline, and one with a chat in flight is re-pushed a full TTL from now
        (its release sets `last_used` later than that). With `limit`, stops after
        that many heap entries, so a caller can yield between batches when many
        sessions come due at once, and call again while `expiry_due()`."""
        now = self._clock()
        heap = self._expiry
        expired: list[str] = []
        budget = len(heap) if limit is None else limit
        while heap and heap[0][0] < now and budget > 0:
            budget -= 1
            _, sid = heapq.heappop(heap)
            s = self._sessions.get(sid)
            if s is None:
                continue  # stale: removed since it was pushed
            if s.inflight is not None:
                heapq.heappush(heap, (now + s.config.ttl_s, sid))
                continue
            deadline = _deadline(s)
            if deadline < now:
                s.gone_reason = "expired (ttl)"
                self._remove(s)
                expired.append(sid)
            else:
                heapq.heappush(heap, (deadline, sid))
        return expired

    def expiry_due(self) -> bool:
        """Whether a sweep now would still pop an entry (one stopped by `limit`)."""
        return bool(self._expiry) and self._expiry[0][0] < self._clock()

    def all(self) -> Mapping[str, Session]:
        return self._sessions
