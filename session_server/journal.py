"""The journal: every session change a crash must not take back, in one SQLite file.

Why SQLite (standard library) in WAL mode: a real embedded database gives atomic
multi-record transactions, a write-ahead log whose frames carry checksums (a frame
torn by a crash mid-write is ignored when the file is next opened, by SQLite itself)
and indexed deletes for compaction, with no server to run. One file per instance
(`{journal_dir}/{instance}.sqlite3`): an instance is the only writer of its journal.

**Writes.** `append` (on the event loop) returns a future that is done when the record
is durable. The records of one loop tick are handed to the writer thread together (one
wake-up), and the writer commits everything handed over while its previous transaction
was syncing as one transaction (group commit: one sync for the turns committed in the
same tick, or more under load). Per commit, not per record, is where the cost is
(~200 us of CPU for SQLite, the WAL's page writes, the fsync and two thread wake-ups;
~25 us per record at 64 a commit: bench/README.md). By default (`sync="full"`,
`synchronous=FULL`) the WAL is fsync'd at every commit, so an acknowledged record
survives a power loss, not only a process crash; `sync="normal"` syncs at checkpoints
only: a killed process still loses nothing acknowledged, a crashed machine may lose the
last commits (journal_file.py). A record is `(seq, sid, kind, at, body, crc)`: `body` is the record's
msgpack (`journal_records.py`), `crc` its CRC-32, checked at recovery.

**Compaction.** When a session leaves the store (delete, expiry, samples close) its
records are deleted in the same transaction that writes its tombstone, so the journal
holds the live sessions and recent tombstones: recovery time follows live state, not
history.

**Bad storage.** A write that fails (a full disk is SQLite's `SQLITE_FULL`, an I/O
error) fails every record of its transaction: the caller undoes the change and answers
503 (`JournalUnavailable`), and for `FAILURE_HOLD_S` new turns are refused before they
reach an engine. At start-up (`read`): a WAL that ends inside a frame was torn by a
crash mid-write; SQLite drops that unfinished transaction (never acknowledged under
`full`; under `normal` a machine's crash can also drop acknowledged ones, and the
warning says that too). A record whose CRC does not match, or a file SQLite cannot
read, stops the start (`JournalCorrupt`, naming the record): under `full`, nothing is
served from a journal that lost data silently.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import queue
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import JournalUnavailable, SessionGone, shown
from .journal_file import SYNC_MODES, connect, journal_path, torn_tail

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

_PRUNE_EVERY = 256
_INSERT = "INSERT INTO records (sid, kind, at, body, crc) VALUES (?, ?, ?, ?, ?)"  # tombstones written between two deletes of the expired ones


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
    `gone` through the writer thread (`start` ... `close`)."""

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
        self._queue: queue.SimpleQueue[list[tuple] | None] = queue.SimpleQueue()
        self._tick: list[tuple] = []  # this loop tick's records, handed over together (`_hand_over`)
        self._handed_at = -1e18  # loop time of the last hand-over
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: sqlite3.Connection | None = None
        self._failed_at = -1e18  # monotonic time of the last failed write
        self.last_error: str | None = None
        self.records_written = 0
        self.syncs = 0
        self.failures = 0
        self.writer_cpu_s = 0.0  # CPU the writer thread spent in transactions (SQLite, the sync)
        self._gone_since_prune = 0  # writer thread only
        self._lock_file = self._take_lock()

    def _take_lock(self) -> object:
        """One process per journal: a second writer would interleave with the first."""
        f = self.path.with_name(self.path.name + ".lock").open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise JournalCorrupt(f"journal {self.path} is in use by another process (give each instance its own "
                                 "--instance-id or --journal-dir)") from None
        return f

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
        try:
            conn = connect(self.path, None)
        except sqlite3.DatabaseError as exc:
            raise JournalCorrupt(f"journal {self.path} cannot be opened as SQLite: {exc}") from exc
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
        """Open the file for writing and start the writer thread."""
        self._loop = loop
        try:
            self._conn = connect(self.path, self._max_bytes, self.sync)
        except sqlite3.DatabaseError as exc:
            raise JournalCorrupt(f"journal {self.path} cannot be opened as SQLite: {exc}") from exc
        self._thread = threading.Thread(target=self._writer, name="tito-journal", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Write what is queued, then stop the writer and close the file."""
        if self._thread is None:
            return
        if self._tick:  # this tick's records go first
            self._hand_over()
        self._queue.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None
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
        assert self._loop is not None, "Journal.start was not called"
        fut = Written(loop=self._loop)
        if sid in self._tombstones:
            fut.set_result(None)
            return fut
        self._add(("rec", sid, kind, time.time(), body, zlib.crc32(body), fut))
        return fut

    def put(self, sid: str, kind: str, body: bytes) -> Written:
        """Queue a record that replaces the earlier ones of its (sid, kind): state kept as
        its latest value (the instance's weight version), not as a history."""
        assert self._loop is not None, "Journal.start was not called"
        fut = Written(loop=self._loop)
        fut.add_done_callback(_seen)
        if sid in self._tombstones:  # as `append`
            fut.set_result(None)
            return fut
        self._add(("put", sid, kind, time.time(), body, zlib.crc32(body), fut))
        return fut

    def gone(self, sid: str, reason: str) -> Written:
        """The session left the store: delete its records and keep a tombstone (410)."""
        assert self._loop is not None, "Journal.start was not called"
        at = time.time()
        self._remember(sid, reason, at)
        fut = Written(loop=self._loop)
        fut.add_done_callback(_seen)  # nobody may wait for it: its error is logged by `_settle`
        self._add(("gone", sid, reason, at, fut))
        return fut

    def barrier(self) -> Written:
        """Done when everything queued before it is durable (a DELETE's tombstone)."""
        assert self._loop is not None, "Journal.start was not called"
        fut = Written(loop=self._loop)
        self._add(("sync", fut))
        return fut

    def _add(self, op: tuple) -> None:
        """Queue `op` with the rest of this loop tick's: one hand-over (one wake-up of the
        writer) per tick, however many turns committed in it."""
        if not self._tick:
            loop = self._loop
            assert loop is not None
            if loop.time() - self._handed_at < BUSY_S:  # busy: let the next turns share this commit
                loop.call_later(HOLD_S, self._hand_over)
            else:
                loop.call_soon(self._hand_over)
        self._tick.append(op)

    def _hand_over(self) -> None:
        ops, self._tick = self._tick, []
        if ops:
            self._queue.put(ops)
            assert self._loop is not None
            self._handed_at = self._loop.time()

    def check_writable(self) -> None:
        """Refuse new work while the last write failed recently (a full disk)."""
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

    # -- the writer thread ---------------------------------------------------------

    def _writer(self) -> None:
        conn = self._conn
        assert conn is not None
        stopping = False
        while not stopping:
            ops = self._queue.get()
            batch: list[tuple] = []
            while ops is not None:  # every tick handed over while the last commit synced
                batch += ops
                try:
                    ops = self._queue.get_nowait()
                except queue.Empty:
                    break
            stopping = ops is None
            if batch:
                try:
                    self._commit(conn, batch)
                except Exception as exc:  # not SQLite's (a bug, memory): this batch fails, the writer lives on
                    self._hand_back(batch, exc)
        conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[tuple]) -> None:
        error: BaseException | None = None
        cpu0 = time.thread_time()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                rows: list[tuple] = []  # consecutive records: one executemany (one GIL hand-back, not one each)
                for op in batch:
                    if op[0] == "rec":
                        rows.append(op[1:6])
                        continue
                    if rows:
                        conn.executemany(_INSERT, rows)
                        rows = []
                    if op[0] == "put":
                        conn.execute("DELETE FROM records WHERE sid = ? AND kind = ?", op[1:3])
                        conn.execute(_INSERT, op[1:6])
                    elif op[0] == "gone":
                        _, sid, reason, at, _fut = op
                        conn.execute("DELETE FROM records WHERE sid = ?", (sid,))
                        conn.execute("INSERT OR REPLACE INTO tombstones (sid, reason, at) VALUES (?, ?, ?)",
                                     (sid, reason, at))
                        self._gone_since_prune += 1
                if rows:
                    conn.executemany(_INSERT, rows)
                if self._gone_since_prune >= _PRUNE_EVERY:
                    self._gone_since_prune = 0
                    conn.execute("DELETE FROM tombstones WHERE at < ?", (time.time() - self.tombstone_ttl_s,))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite rolls back itself on SQLITE_FULL
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            error = exc
        self.writer_cpu_s += time.thread_time() - cpu0  # only this thread writes it
        self._hand_back(batch, error)

    def _hand_back(self, batch: list[tuple], error: BaseException | None) -> None:
        """The batch's outcome to the loop: every waiting change is answered, done or failed
        (a writer that stopped answering would leave turns waiting forever)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._settle, [op[-1] for op in batch], error, len(batch))
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _settle(self, futures: list[Written], error: BaseException | None, n: int) -> None:
        if error is None:
            self.records_written += n
            self.syncs += 1
        else:
            self.failures += 1
            self._failed_at = time.monotonic()
            self.last_error = str(error)
            _log.error("journal %s: a write of %d records failed: %s", self.path, n, error)
        for fut in futures:
            if fut.done():
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(JournalUnavailable(
                    f"the session journal could not store this change ({error}); nothing was committed"))
