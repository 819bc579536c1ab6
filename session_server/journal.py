"""The journal: every session change a crash must not take back, in one SQLite file.

Why SQLite (standard library) in WAL mode: a real embedded database gives atomic
multi-record transactions, a write-ahead log whose frames carry checksums (a frame
torn by a crash mid-write is ignored when the file is next opened, by SQLite itself)
and indexed deletes for compaction, with no server to run. One file per instance
(`{journal_dir}/{instance}.sqlite3`): an instance is the only writer of its journal.

**Writes.** `append` (on the event loop) returns a future that is done when the record
is durable. The records of one loop tick are sent to the writer process together (one
frame on a socket, `journal_writer.py`), and the writer commits everything that arrived
while its previous transaction was syncing as one transaction (group commit: one sync
for the turns committed in the same tick, or more under load), then acknowledges it.
The writer is a process, not a thread, so its SQLite calls never take this process's
GIL (measured against a writer thread: about half the journal's CPU a turn;
bench/README.md, "Durable sessions"). By default (`sync="full"`, `synchronous=FULL`)
the WAL is fsync'd at every commit, so an acknowledged record survives a power loss,
not only a process crash; `sync="normal"` syncs at checkpoints only: a killed process
still loses nothing acknowledged, a crashed machine may lose the last commits
(journal_file.py). A record is `(seq, sid, kind, at, body, crc)`: `body` is the
record's msgpack (`journal_records.py`), `crc` its CRC-32, checked at recovery.

**Compaction.** When a session leaves the store (delete, expiry, samples close) its
records are deleted in the same transaction that writes its tombstone, so the journal
holds the live sessions and recent tombstones: recovery time follows live state, not
history.

**Bad storage.** A write that fails (a full disk is SQLite's `SQLITE_FULL`, an I/O
error) fails every record of its transaction: the caller undoes the change and answers
503 (`JournalUnavailable`), and for `FAILURE_HOLD_S` new turns are refused before they
reach an engine. A writer process that dies (killed, or an error that is not SQLite's)
fails every change waiting for it the same way, and every later one: this process never
writes again (a change it sent may be stored unacknowledged, so its sessions here may
lack what the file holds); `serve` then exits (status 70, `durability.py`) so that its
restart replays the file. At start-up (`read`): a WAL that
ends inside a frame was torn by a crash mid-write; SQLite drops that unfinished
transaction (never acknowledged under `full`; under `normal` a machine's crash can also
drop acknowledged ones, and the warning says that too). A record whose CRC does not
match, or a file SQLite cannot read, stops the start (`JournalCorrupt`, naming the
record): under `full`, nothing is served from a journal that lost data silently.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import sqlite3
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import JournalUnavailable, SessionGone, shown
from .journal_file import SYNC_MODES, connect, journal_path, torn_tail
from .journal_writer import GONE, PUT, REC, SYNC, Op, WriterProcess

__all__ = ["FAILURE_HOLD_S", "JOURNAL_EXIT_STATUS", "Journal", "JournalCorrupt", "Row", "Written", "durable",
           "journal_path", "settled"]

_log = logging.getLogger("session_server")

JOURNAL_EXIT_STATUS = 65
"""A `serve` whose journal does not replay exits with this (the cluster does not restart
it): sysexits' EX_DATAERR, distinct from uvicorn's start-up failure (3), which is restarted."""

FAILURE_HOLD_S = 5.0
"""After a failed write, how long new turns are refused up front (then one may try)."""

HOLD_S, BUSY_S = 0.002, 0.01
"""Under load (a hand-over within `BUSY_S`), a record waits `HOLD_S` for the turns that
commit next to share its transaction: a commit costs ~200 us of CPU whatever it holds,
so at hundreds of turns a second a 2 ms wait halves the commits or better. An idle
journal hands a record over at the end of its loop tick."""

CLOSE_WAIT_S = 30.0
"""How long `close` waits for the writer to commit what it has and exit, before killing it."""

LOCK_WAIT_S = 5.0
"""How long a starting instance waits for the journal's lock (see `Journal._take_lock`)."""


class JournalCorrupt(RuntimeError):
    """The journal holds a record that is not what was written: the instance must not start."""


@dataclass(frozen=True, slots=True)
class Row:
    """One stored record, in write order."""

    seq: int
    sid: str
    kind: str
    at: float  # wall-clock time it was written (time.time())
    body: bytes


def _connect(path: Path, max_bytes: int | None, sync: str = "full") -> sqlite3.Connection:
    try:
        return connect(path, max_bytes, sync)
    except sqlite3.DatabaseError as exc:
        raise JournalCorrupt(f"journal {path} cannot be opened as SQLite: {exc}") from exc


class Written(asyncio.Future[None]):
    """A record's durability: done when its transaction committed (or failed). It cannot
    be cancelled: a task cancelled while it waits gets its `CancelledError` once the
    outcome is known (`settled`), because that outcome decides whether a change stands.
    Awaited directly, with no `asyncio.shield` hop: under load each loop hop is
    milliseconds of the turn's latency."""

    def cancel(self, msg: Any = None) -> bool:
        return False


async def settled(written: Written) -> bool:
    """Wait for `written`: its error raised (`JournalUnavailable`), else whether a cancel
    of the waiting task arrived meanwhile (the caller re-raises it when it has finished
    what the outcome obliges it to do)."""
    try:
        await written
    except asyncio.CancelledError:
        if not written.done():  # not ours: the wait itself was interrupted some other way
            raise
        written.result()
        return True
    return False


async def durable(written: Written) -> None:
    """Wait for `written`: its error raised; a cancel that came meanwhile raised after."""
    if await settled(written):
        raise asyncio.CancelledError


def _seen(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class Journal:
    """One instance's journal: read once at start (`read`), then written by `append` and
    `gone` through the writer process (`start` ... `close`)."""

    def __init__(self, path: Path, *, max_bytes: int | None = None, tombstone_ttl_s: float = 3600.0,
                 max_tombstones: int = 500_000, sync: str = "full") -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"unknown journal sync {sync!r}; choose from {', '.join(SYNC_MODES)}")
        self.path = path
        self._max_bytes = max_bytes
        self.sync = sync
        self.tombstone_ttl_s = tombstone_ttl_s
        self.max_tombstones = max_tombstones
        self._tombstones: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._tick: list[Op] = []  # this loop tick's ops, sent together (`_hand_over`)
        self._tick_futures: list[Written] = []
        self._waiting: collections.deque[Written] = collections.deque()  # sent, not yet acknowledged, in order
        self._handed_at = -1e18  # loop time of the last hand-over
        self._writer: WriterProcess | None = None
        self._closing = False  # `close` began: nothing more is sent
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: asyncio.Future[None] | None = None  # done when the writer's socket closed
        self._failed_at = -1e18  # monotonic time of the last failed write
        self.dead: str | None = None  # why the writer process is gone (then nothing is written again)
        self.on_dead: Callable[[str], None] | None = None  # told once, when the writer dies (not at `close`)
        self.last_error: str | None = None
        self.records_written = 0
        self.syncs = 0
        self.failures = 0
        self.writer_cpu_s = 0.0  # CPU the writer process used (SQLite, the sync, reading the ops)
        self._lock_file = self._take_lock()

    def _take_lock(self) -> object:
        """One process per journal: a second writer would interleave with the first. The
        writer process of an instance that just died holds the lock until the kernel has
        ended it too (milliseconds), so a restart waits `LOCK_WAIT_S` for it first."""
        f = self.path.with_name(self.path.name + ".lock").open("a+")
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return f
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                f.close()
                raise JournalCorrupt(f"journal {self.path} is in use by another process (give each instance its "
                                     "own --instance-id or --journal-dir)") from None

    # -- start-up ------------------------------------------------------------------

    def read(self) -> Iterator[Row]:
        """Every record in write order, each checked (blocking: run it off the loop
        before `start`). Raises `JournalCorrupt` naming the first bad record."""
        torn = torn_tail(self.path)
        if torn:
            _log.warning("journal %s: the last write was torn by a crash (%d bytes of an unfinished WAL frame); "
                         "SQLite drops it: %s", self.path, torn,
                         "it was never acknowledged" if self.sync == "full" else
                         "with journal sync normal, it may hold changes that were acknowledged")
        conn = _connect(self.path, None)
        try:
            self._load_tombstones(conn)
            cur = conn.execute("SELECT seq, sid, kind, at, body, crc FROM records ORDER BY seq")
            for seq, sid, kind, at, body, crc in cur:
                if zlib.crc32(body) != crc:
                    raise JournalCorrupt(f"journal {self.path}: record {seq} ({kind} of session {shown(sid)}) "
                                         "fails its checksum; the file was damaged after it was written. Restore "
                                         "it from a backup, or move it away to start with no sessions")
                yield Row(seq, sid, kind, at, bytes(body))
        except sqlite3.DatabaseError as exc:
            raise JournalCorrupt(f"journal {self.path} is damaged: {exc}") from exc
        finally:
            conn.close()

    def _load_tombstones(self, conn: sqlite3.Connection) -> None:
        cutoff = time.time() - self.tombstone_ttl_s
        conn.execute("DELETE FROM tombstones WHERE at < ?", (cutoff,))
        rows = conn.execute("SELECT sid, reason, at FROM tombstones ORDER BY at").fetchall()
        for sid, reason, at in rows[-self.max_tombstones:]:
            self._tombstones[sid] = (reason, at)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Check the file opens for writing and start the writer process (from the loop's
        thread: the writer dies with it)."""
        self._loop = loop
        _connect(self.path, self._max_bytes, self.sync).close()
        self._ended = loop.create_future()
        self._writer = WriterProcess(loop, self.path, max_bytes=self._max_bytes, sync=self.sync,
                                     tombstone_ttl_s=self.tombstone_ttl_s,
                                     lock_fd=self._lock_file.fileno(),  # type: ignore[attr-defined]
                                     on_ack=self._settle, on_end=self._writer_ended)

    @property
    def writer_pid(self) -> int | None:
        return None if self._writer is None else self._writer.proc.pid

    async def close(self) -> None:
        """Write what is queued, then stop the writer and close the file."""
        writer = self._writer
        if writer is None or self._closing:
            return
        if self._tick:  # this tick's records go first
            self._hand_over()
        self._closing = True
        writer.finish()
        assert self._ended is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), CLOSE_WAIT_S)
        except TimeoutError:  # a writer that stopped answering (stopped, stuck in I/O): what waits fails
            _log.error("journal %s: the writer did not finish within %.0f s; stopping it", self.path, CLOSE_WAIT_S)
            writer.kill()
            await asyncio.shield(self._ended)
        await writer.wait()
        self._writer = None
        self.release()

    def release(self) -> None:
        """Let another process open this journal (the writer is stopped or never ran)."""
        lock, self._lock_file = self._lock_file, None
        if lock is not None:
            lock.close()  # type: ignore[attr-defined]

    # -- writing -------------------------------------------------------------------

    def append(self, sid: str, kind: str, body: bytes) -> Written:
        """Queue one record; `Written` is done when it is durable (or failed). A record of
        a session already gone (its tombstone written: a Responses object of a turn that
        outlived its session's DELETE) is not written: its session is nowhere to replay."""
        if sid in self._tombstones:
            return self._done()
        return self._add((REC, sid, kind, time.time(), body))

    def put(self, sid: str, kind: str, body: bytes) -> Written:
        """Queue a record that replaces the earlier ones of its (sid, kind): state kept as
        its latest value (the instance's weight version), not as a history."""
        fut = self._done() if sid in self._tombstones else self._add((PUT, sid, kind, time.time(), body))  # as `append`
        fut.add_done_callback(_seen)
        return fut

    def gone(self, sid: str, reason: str) -> Written:
        """The session left the store: delete its records and keep a tombstone (410)."""
        at = time.time()
        self._remember(sid, reason, at)
        fut = self._add((GONE, sid, reason, at, b""))
        fut.add_done_callback(_seen)  # nobody may wait for it: its error is logged by `_settle`
        return fut

    def barrier(self) -> Written:
        """Done when everything queued before it is durable (a DELETE's tombstone)."""
        return self._add((SYNC, "", "", 0.0, b""))

    def _done(self) -> Written:
        assert self._loop is not None, "Journal.start was not called"
        fut = Written(loop=self._loop)
        fut.set_result(None)
        return fut

    def _add(self, op: Op) -> Written:
        """Queue `op` with the rest of this loop tick's: one frame to the writer per tick,
        however many turns committed in it."""
        loop = self._loop
        assert loop is not None, "Journal.start was not called"
        fut = Written(loop=loop)
        if self.dead is not None:
            fut.set_exception(self._unavailable(self.dead))
            return fut
        if not self._tick:
            if loop.time() - self._handed_at < BUSY_S:  # busy: let the next turns share this commit
                loop.call_later(HOLD_S, self._hand_over)
            else:
                loop.call_soon(self._hand_over)
        self._tick.append(op)
        self._tick_futures.append(fut)
        return fut

    def _hand_over(self) -> None:
        ops, self._tick = self._tick, []
        futures, self._tick_futures = self._tick_futures, []
        writer = self._writer
        if not ops:
            return
        if writer is None or self._closing or self.dead is not None:
            self._fail(futures, self.dead or "the journal is closed")
            return
        try:
            frame = writer.frame(ops)
        except Exception as exc:  # not encodable (a bug): these fail, nothing is sent, acks stay in step
            self._fail(futures, f"its records could not be encoded: {exc}")
            return
        self._waiting += futures  # before the send: a send that fails finds them waiting
        assert self._loop is not None
        self._handed_at = self._loop.time()
        writer.send(frame)

    def check_writable(self) -> None:
        """Refuse new work while the last write failed recently (a full disk), and for good
        once the writer process is gone."""
        if self.dead is not None:
            raise JournalUnavailable(f"the session journal cannot be written ({self.dead}); nothing is committed "
                                     "on this instance until it restarts")
        if time.monotonic() - self._failed_at < FAILURE_HOLD_S:
            raise JournalUnavailable(f"the session journal cannot be written ({self.last_error}); nothing is "
                                     "committed until it can be: free space on its volume")

    def check_gone(self, sid: str) -> None:
        """410 for a session this instance closed within the tombstone time."""
        stone = self._tombstones.get(sid)
        if stone is None:
            return
        reason, at = stone
        if time.time() - at > self.tombstone_ttl_s:
            del self._tombstones[sid]
            return
        raise SessionGone(f"session {shown(sid)} is gone ({reason}); start a new session")

    def _remember(self, sid: str, reason: str, at: float) -> None:
        self._tombstones[sid] = (reason, at)
        self._tombstones.move_to_end(sid)
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)

    # -- the writer's answers ------------------------------------------------------

    def _settle(self, n: int, cpu_s: float, error: str | None) -> None:
        """The writer's ack: its next `n` ops are durable (`error` None) or failed."""
        self.writer_cpu_s = cpu_s
        futures = [self._waiting.popleft() for _ in range(min(n, len(self._waiting)))]
        if error is None:
            self.records_written += n
            self.syncs += 1
            for fut in futures:
                if not fut.done():
                    fut.set_result(None)
            return
        self.failures += 1
        self._failed_at = time.monotonic()
        self.last_error = error
        _log.error("journal %s: a write of %d records failed: %s", self.path, n, error)
        for fut in futures:
            if not fut.done():
                fut.set_exception(JournalUnavailable(
                    f"the session journal could not store this change ({error}); nothing was committed"))

    def _writer_ended(self, why: str) -> None:
        """The writer's socket closed: after `close`, its clean exit; else it died, and
        nothing is written again (what it was sent is failed, stored or not)."""
        if not self._closing:  # it died
            self.dead = why
            if self._waiting or self._tick:
                _log.error("journal %s: %s with %d changes not acknowledged; this instance refuses every new "
                           "change until it restarts (the restart replays what the file holds)", self.path, why,
                           len(self._waiting) + len(self._tick))
            else:
                _log.error("journal %s: %s; this instance refuses every new change until it restarts", self.path, why)
        waiting, self._waiting = list(self._waiting), collections.deque()
        self._fail(waiting, self.dead or why)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        if self.dead is not None and self.on_dead is not None:
            self.on_dead(self.dead)

    def _fail(self, futures: list[Written], why: str) -> None:
        for fut in futures:
            if not fut.done():
                fut.set_exception(self._unavailable(why))

    @staticmethod
    def _unavailable(why: str) -> JournalUnavailable:
        return JournalUnavailable(f"the session journal could not store this change ({why}); it is not "
                                  "committed here (a restart replays whatever the file holds)")
