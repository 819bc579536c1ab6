"""Idempotent retries: a request an SDK replays never becomes a second turn.

SDKs retry a request that timed out or lost its connection: the `openai` and
`anthropic` Python SDKs send `x-stainless-retry-count: N` (0 on the first attempt),
other clients an `Idempotency-Key`. A request is a **replay** of an earlier one on
the same session and route (dialect) when

- it carries an `Idempotency-Key` that an earlier request carried: the key names the
  request by itself; the same key with another body is refused with 422
  `idempotency_key_reused` (IETF draft-ietf-httpapi-idempotency-key-header), or
- it carries `x-stainless-retry-count` > 0, its body's digest (SHA-256 of the raw
  bytes) equals an earlier request's, and that request is the attempt it retries: an
  original in flight, or a committed one whose turn no later turn extends
  (`Session.built_on`). A client that built on a response had it, so its later
  identical request (an agent resending an earlier prompt to sample again, whose own
  first attempt never reached the server and only its retry did) is a new turn: the
  count says "a retry", not "of which request". Turns committed meanwhile on other
  branches (a harness's concurrent side request) do not count: the original's client
  still has no answer.

The log answers each request with a `Decision` (`ReplayLog.decide`): `Refuse`,
`Replay` (stored bytes), `Follow` (a live stream) or `RunFresh` (run the turn; its
outcome goes back through `RunFresh.keep`). A replay of a request still in flight waits
for it (no 409) and gets its response (a streamed original whose response has begun, or
begins while the replay waits, is followed instead: `Follow` names its live stream,
which the replay sends every frame of from the first, then the rest as they come; a
response begins when its turn streams, or early when the request has waited
`keepalive_s` for its session: live.py); of a committed one, the stored response (the
same bytes: a JSON body, or the same SSE frames). If the original fails (any error, or its client left and the turn was
discarded), nothing is stored and the replay runs as a fresh attempt: it is the
client's retry. The one exception is an original whose turn committed and whose
response then failed (`CommittedUnanswered`): its replays get that same error, never a
second commit of the turn. A request that carries neither header is not recorded and
is never a replay: resending it is a deliberate retry (`trajectory` rolls back to a
new branch).

A recorded request whose client disconnects mid-turn keeps its turn for
`replay_grace_s`: an SDK that timed out comes back within its backoff, and its replay
then adopts the turn, which runs on to commit (a slow turn is not cancelled on every
timeout, so the SDK gets the answer on a later attempt). If no replay comes within the
grace, the turn is cancelled as today (nothing committed).

Memory is bounded: per session the last `replay_per_session` committed responses, and
`replay_store_bytes` over all sessions (oldest evicted first); a session's records go
with the session. A replay of an evicted response is a new request (for the last turn:
a rollback to a new branch, as any resend).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadRequest, CommittedUnanswered, IdempotencyKeyReused
from ..metrics import Metrics
from ..offload import CpuOffload
from .live import LiveTurn
from .output import Rendered
from .pipeline import ClientWatch

__all__ = ["IDEMPOTENCY_KEY", "RETRY_COUNT", "Decision", "Follow", "Ident", "Refuse", "Replay", "ReplayLog",
           "Rerender", "RunFresh", "identify"]

RETRY_COUNT = "x-stainless-retry-count"
IDEMPOTENCY_KEY = "idempotency-key"
MAX_KEY_CHARS = 255


@dataclass(frozen=True)
class Ident:
    """Who a turn request is, for replay detection: its session, route and body digest,
    and what the client said about retrying."""

    session_id: str
    route: str
    digest: bytes
    key: str | None  # Idempotency-Key
    retry_count: int | None  # x-stainless-retry-count (None: absent or not an integer)
    built_on: Callable[[tuple[int, int]], bool] | None = None  # Session.built_on (None: not tracked)

    @property
    def recorded(self) -> bool:
        """A client that sends either header may retry: its request is remembered."""
        return self.key is not None or self.retry_count is not None


def _retry_count(headers: Mapping[str, str]) -> int | None:
    raw = headers.get(RETRY_COUNT)
    if raw is None:
        return None
    try:
        return max(0, int(raw.strip()))
    except ValueError:
        return None  # not ours to judge: an unreadable count is no claim of a retry


def _key(headers: Mapping[str, str]) -> str | None:
    key = (headers.get(IDEMPOTENCY_KEY) or "").strip()
    if len(key) > MAX_KEY_CHARS:
        raise BadRequest(f"Idempotency-Key is longer than {MAX_KEY_CHARS} characters")
    return key or None


def _sha256(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


async def identify(offload: CpuOffload, session_id: str, route: str, headers: Mapping[str, str], body: bytes,
                   *, built_on: Callable[[tuple[int, int]], bool] | None = None) -> Ident:
    """The request's `Ident`; the digest is O(body), so a large body hashes off the loop."""
    key, count = _key(headers), _retry_count(headers)
    digest = await offload.run_sized(len(body), _sha256, body) if key or count is not None else b""
    return Ident(session_id, route, digest, key, count, built_on)


class _Entry:
    """One recorded request: in flight until `done`, then stored (`rendered`) or gone."""

    __slots__ = ("adopted", "digest", "done", "failure", "key", "live", "matched_stop", "rendered", "route", "turn",
                 "unanswered")

    def __init__(self, ident: Ident, live: LiveTurn | None = None) -> None:
        self.route, self.digest, self.key = ident.route, ident.digest, ident.key
        self.turn: tuple[int, int] | None = None  # (branch id, turn index) once committed
        self.done = asyncio.Event()
        self.adopted = asyncio.Event()  # a replay waits for this turn
        self.rendered: Rendered | None = None
        self.failure: CommittedUnanswered | None = None  # committed, its response failed: replays get this
        self.live = live  # the request's live stream, followed by replays once its response began
        self.unanswered = False  # committed before a crash, its response lost: a replay renders it (Rerender)
        self.matched_stop: Any = None  # the engine's matched stop of that turn (not in the trajectory)


@dataclass(frozen=True)
class Refuse:
    """The original's turn committed and its response failed: this replay gets that same
    error (never a second commit of the turn)."""

    error: CommittedUnanswered


@dataclass(frozen=True)
class Replay:
    """Answer with the original's response bytes (stored, or the in-flight original's
    once it committed)."""

    rendered: Rendered


@dataclass(frozen=True)
class Follow:
    """The in-flight original streams now: send its live stream, every frame from the
    first (`LiveTurn.follow`); `ReplayLog.followed` is this replay's own wait for it."""

    live: LiveTurn
    _entry: _Entry = field(repr=False)


class RunFresh:
    """No recorded request answers this one: run the turn. A recorded request (one with
    a retry header) is in the log from now on, in flight: `held` keeps its turn past a
    hang-up for the replay grace, and `keep` gives the log its outcome."""

    __slots__ = ("_entry", "_log", "_session_id")

    def __init__(self, log: ReplayLog | None = None, session_id: str = "", entry: _Entry | None = None) -> None:
        self._log, self._session_id, self._entry = log, session_id, entry

    @property
    def recorded(self) -> bool:
        """Whether a retry of this request may come back for its turn (see the module doc)."""
        return self._entry is not None

    @property
    def identity(self) -> tuple[str, bytes, str | None] | None:
        """(route, digest, key) of a recorded request: journaled with its turn, so a retry
        after a crash is known for the turn it committed (`ReplayLog.restore`)."""
        e = self._entry
        return None if e is None else (e.route, e.digest, e.key)

    def held(self, gone: ClientWatch) -> ClientWatch:
        """`gone`, unless a replay adopts the turn: after the client hangs up, wait up to
        the grace for a replay; adopted, the watcher never fires and the turn commits."""
        log, entry = self._log, self._entry
        if log is None or entry is None:
            return gone

        async def held() -> None:
            await gone()
            if not entry.adopted.is_set():
                try:
                    await asyncio.wait_for(entry.adopted.wait(), log.grace_s)
                except TimeoutError:
                    return  # nobody came back for it: the turn is cancelled
            await _forever()

        return held

    async def keep(self, turn: Awaitable[Rendered]) -> Rendered:
        """`turn`'s response, stored for replays; a turn that failed leaves nothing (its
        replays run afresh), one that committed and failed to answer leaves its error."""
        log, entry = self._log, self._entry
        if log is None or entry is None:
            return await turn
        try:
            rendered = await turn
        except CommittedUnanswered as exc:
            log._store(self._session_id, entry, None, failure=exc)  # a retry gets the same error, not a new turn
            raise
        except BaseException:
            log._drop(self._session_id, entry)
            entry.done.set()
            raise
        log._store(self._session_id, entry, rendered)
        return rendered

    def settle(self, task: asyncio.Future[Any]) -> None:
        """A done-callback for the task that runs `keep`: a task cancelled before its
        first step never ran `keep`, so its entry would stay in flight and every retry
        would wait on it forever; here it goes as a failed original's does."""
        log, entry = self._log, self._entry
        if log is not None and entry is not None and not entry.done.is_set():
            log._drop(self._session_id, entry)
            entry.done.set()


@dataclass(frozen=True)
class Rerender:
    """The original's turn was committed before a crash and its response was lost with
    the process: answer by rendering that turn again (then `ReplayLog.answered`)."""

    turn: tuple[int, int]
    matched_stop: Any
    _entry: _Entry = field(repr=False)


Decision = Refuse | Replay | Follow | Rerender | RunFresh
"""What the log says to do with a request (`ReplayLog.decide`)."""


async def _opens(entry: _Entry, live: LiveTurn) -> bool:
    """Whether the in-flight original's response begins (`LiveTurn.opened`: its turn
    streams, or it waited long enough to begin without it) before it ends: a replay
    then follows it from its first frame, instead of waiting silently for its end."""
    if live.opened.is_set():
        return True
    opened = asyncio.ensure_future(live.opened.wait())
    done = asyncio.ensure_future(entry.done.wait())
    try:
        await asyncio.wait([opened, done], return_when=asyncio.FIRST_COMPLETED)
    finally:
        opened.cancel()
        done.cancel()
    return bool(live.opened.is_set() and not entry.done.is_set())


async def _forever() -> None:
    await asyncio.Event().wait()


class ReplayLog:
    """Recorded requests of every session: the in-flight ones and the last committed
    responses. Loop-only state (no locks): every method runs on the event loop."""

    def __init__(self, metrics: Metrics, *, per_session: int, max_bytes: int, grace_s: float) -> None:
        self._metrics = metrics
        self.per_session, self.max_bytes, self.grace_s = per_session, max_bytes, grace_s
        self._sessions: dict[str, list[_Entry]] = {}  # oldest first
        self._stored: OrderedDict[_Entry, str] = OrderedDict()  # stored entry -> session, oldest first
        self._bytes = 0

    def restore(self, session_id: str, recorded: Sequence[Any], turn: tuple[int, int], matched_stop: Any) -> None:
        """A recorded request whose turn the journal holds (start-up): its response was
        lost with the process, so a retry of it is answered by rendering that committed
        turn again (`Rerender`), never by a second turn."""
        route, digest, key = recorded
        entry = _Entry(Ident(session_id, route, digest, key, None))
        entry.turn, entry.matched_stop = turn, matched_stop
        entry.unanswered = True
        entry.done.set()
        self._sessions.setdefault(session_id, []).append(entry)
        entries = self._sessions[session_id]
        if len(entries) > self.per_session:  # the newest few, as for stored responses
            del entries[: len(entries) - self.per_session]

    def answered(self, session_id: str, rerender: Rerender, rendered: Rendered) -> None:
        """The response a `Rerender` built: stored, so a further retry gets these bytes."""
        entry = rerender._entry
        entry.unanswered = False
        if entry in self._sessions.get(session_id, ()):
            self._store(session_id, entry, rendered)

    async def decide(self, ident: Ident, live: LiveTurn | None = None) -> Decision:
        """What to do with `ident`'s request: a replay of an in-flight original waits
        here for it to commit (or, when the original's response begins meanwhile and
        `live`, this request's own stream, is given, is told to `Follow` it); an original
        that failed is looked for again, then this request runs as a fresh attempt.
        `live` is kept for the replays of this request when it runs."""
        while (entry := self._find(ident)) is not None:
            if entry.unanswered and entry.turn is not None:  # committed before a restart
                self._served("stored")
                return Rerender(entry.turn, entry.matched_stop, entry)
            if entry.failure is not None:  # its turn is committed: never run it again
                self._served("failed")
                return Refuse(CommittedUnanswered(entry.failure.message))
            if entry.rendered is not None:
                self._served("stored")
                return Replay(entry.rendered)
            entry.adopted.set()
            if live is not None and entry.live is not None and await _opens(entry, entry.live):
                return Follow(entry.live, entry)
            await entry.done.wait()
            if entry.failure is not None:
                self._served("failed")
                return Refuse(CommittedUnanswered(entry.failure.message))
            if entry.rendered is None:
                continue  # the original failed: look again, then run as a fresh attempt
            self._served("in_flight")
            return Replay(entry.rendered)
        if not ident.recorded:
            return RunFresh()
        entry = _Entry(ident, live)
        self._sessions.setdefault(ident.session_id, []).append(entry)
        return RunFresh(self, ident.session_id, entry)

    async def followed(self, follow: Follow) -> None:
        """A follower's wait for the original it follows, to its end (counted as a
        replay served in flight, or one that failed after the commit)."""
        entry = follow._entry
        await entry.done.wait()
        if entry.failure is not None:
            self._served("failed")
        elif entry.rendered is not None:
            self._served("in_flight")
        # else: the original failed after its response began; the follower was sent its error event

    def forget(self, session_id: str) -> None:
        """The session left the store: its records go with it."""
        for entry in self._sessions.pop(session_id, []):
            self._unstore(entry)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def _find(self, ident: Ident) -> _Entry | None:
        """The newest recorded request `ident` replays, if any (see the module doc)."""
        if ident.key is None and not ident.retry_count:
            return None
        for entry in reversed(self._sessions.get(ident.session_id, ())):
            if entry.route != ident.route:
                continue
            if ident.key is not None:
                if entry.key != ident.key:
                    continue
                if entry.digest != ident.digest:
                    raise IdempotencyKeyReused(
                        f"Idempotency-Key {ident.key!r} was already used on this session for another request "
                        "body; a key names one request: send a new key for a new request")
                return entry
            if entry.digest == ident.digest and self._retries(entry, ident):
                return entry
        return None

    @staticmethod
    def _retries(entry: _Entry, ident: Ident) -> bool:
        """Whether `ident` (a retry by its count) retries `entry`'s attempt: `entry` is in
        flight, or committed and no later turn extends its turn (see the module doc)."""
        if not entry.done.is_set():
            return True  # in flight
        if entry.turn is None or ident.built_on is None:
            return True  # not tracked (a log used without sessions)
        return not ident.built_on(entry.turn)

    def _store(self, session_id: str, entry: _Entry, rendered: Rendered | None, *,
               failure: CommittedUnanswered | None = None) -> None:
        """Keep a committed original's response (or, `failure`, the error its response
        became: no bytes), bounded with the rest per session and in bytes."""
        entry.rendered, entry.failure = rendered, failure
        entry.turn = rendered.turn if rendered is not None else (failure.turn if failure is not None else None)
        entry.done.set()
        if session_id not in self._sessions:  # the session was removed meanwhile
            return
        self._stored[entry] = session_id
        self._bytes += rendered.size if rendered is not None else 0
        stored = [e for e in self._sessions[session_id] if e in self._stored]
        for old in stored[: max(0, len(stored) - self.per_session)]:
            self._evict(old)
        while self._bytes > self.max_bytes and self._stored:
            self._evict(next(iter(self._stored)))
        self._metrics.replay_store_bytes.set(self._bytes)

    def _evict(self, entry: _Entry) -> None:
        session_id = self._stored.get(entry)
        if session_id is not None:
            self._drop(session_id, entry)
            self._metrics.replays_evicted_total.inc()

    def _drop(self, session_id: str, entry: _Entry) -> None:
        entries = self._sessions.get(session_id)
        if entries is not None and entry in entries:
            entries.remove(entry)
            if not entries:
                del self._sessions[session_id]
        self._unstore(entry)

    def _unstore(self, entry: _Entry) -> None:
        if self._stored.pop(entry, None) is not None and entry.rendered is not None:
            self._bytes -= entry.rendered.size
            self._metrics.replay_store_bytes.set(self._bytes)

    def _served(self, source: str) -> None:
        self._metrics.replays_total.labels(source=source).inc()
