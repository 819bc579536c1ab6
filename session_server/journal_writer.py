"""The journal's writer process: it alone writes the SQLite file, fed over a socket.

Why a process and not a thread of `serve`: a writer thread shares the server's GIL, and
every SQLite call it makes hands the GIL back to the event loop and waits to take it
again (a bound parameter, each step, the sync). Measured in a serving process under 64
agents, a thread's transaction of ~11 records took 3-4 ms of wall time (p50; the
stand-alone transaction: 0.2 ms) and ~500 us of its CPU against 150-200 us alone: a
thread committing while another runs Python spends ~3x the CPU on the same SQLite work,
while a process burning the other core leaves it unchanged (bench/README.md, "Durable
sessions"). Here the loop only writes one frame per tick to a socket and reads one
acknowledgement per transaction, and this process does the rest on its own GIL: in
the same runs, about half the journal's CPU a turn and 7-13% less p99 latency than a
thread.

**Protocol** (a stream socket, `socket.socketpair`). `serve` -> writer: frames, each a
4-byte little-endian length and a msgpack array of ops `(code, sid, kind_or_reason, at,
body)`. Writer -> `serve`: per transaction, an ack `<IdI>`: how many ops it settled (the
next ones in the order sent), this process's CPU seconds so far, and the length of an
error text that follows (0: committed and synced). Group commit: every frame that
arrived while the previous transaction synced goes into the next one.

**Lifetime.** Started by `Journal.start` from the event-loop thread, it dies with
`serve` (`parent_death.die_with_parent`: SIGKILL, so an unfinished transaction is rolled
back by SQLite; it was never acknowledged) and holds the journal's lock file too (its
descriptor is inherited), so no new instance opens the file while it might still write.
It runs in its own session and ignores SIGINT and SIGTERM: a Ctrl-C or a supervisor's
SIGTERM to `serve`'s process group must not end it while `serve` drains. On the end of
its input (`Journal.close`) it commits the complete frames it has, acknowledges them and
exits. Any error that is not SQLite's ends it: `serve` sees the socket close, refuses
every new change and exits (`Journal`, `durability.py`).
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import sqlite3
import struct
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec

from .child_process import ignore_interrupts, spawn
from .journal_file import connect

__all__ = ["GONE", "PUT", "REC", "SYNC", "Op", "WriterProcess", "main"]

REC, PUT, GONE, SYNC = 0, 1, 2, 3
"""Op codes: a record; a record replacing its (sid, kind)'s earlier ones; a session gone
(its records deleted, its tombstone written: compaction in the same transaction); a
barrier (nothing written: acknowledged once everything before it is durable)."""

FRAME = struct.Struct("<I")
ACK = struct.Struct("<IdI")

_PRUNE_EVERY = 256
_INSERT = "INSERT INTO records (sid, kind, at, body, crc) VALUES (?, ?, ?, ?, ?)"
_READ = 1 << 20
_ops = msgspec.msgpack.Decoder(list[tuple[int, str, str, float, bytes]])
_encode = msgspec.msgpack.Encoder().encode
Op = tuple[int, str, str, float, bytes]


class _Writer:
    def __init__(self, conn: sqlite3.Connection, tombstone_ttl_s: float) -> None:
        self.conn = conn
        self.tombstone_ttl_s = tombstone_ttl_s
        self.gone_since_prune = 0

    def commit(self, batch: list[tuple[int, str, str, float, bytes]]) -> str | None:
        """One transaction for `batch`: None when it is synced, else SQLite's error."""
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                rows: list[tuple] = []  # consecutive records: one executemany
                for code, sid, kind, at, body in batch:
                    if code == REC:
                        rows.append((sid, kind, at, body, zlib.crc32(body)))
                        continue
                    if rows:
                        conn.executemany(_INSERT, rows)
                        rows = []
                    if code == PUT:
                        conn.execute("DELETE FROM records WHERE sid = ? AND kind = ?", (sid, kind))
                        conn.execute(_INSERT, (sid, kind, at, body, zlib.crc32(body)))
                    elif code == GONE:
                        conn.execute("DELETE FROM records WHERE sid = ?", (sid,))
                        conn.execute("INSERT OR REPLACE INTO tombstones (sid, reason, at) VALUES (?, ?, ?)",
                                     (sid, kind, at))
                        self.gone_since_prune += 1
                if rows:
                    conn.executemany(_INSERT, rows)
                if self.gone_since_prune >= _PRUNE_EVERY:
                    self.gone_since_prune = 0
                    conn.execute("DELETE FROM tombstones WHERE at < ?", (time.time() - self.tombstone_ttl_s,))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite rolls back itself on SQLITE_FULL
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            return str(exc) or type(exc).__name__
        return None


def _frames(buf: bytearray) -> tuple[list[tuple[int, str, str, float, bytes]], int]:
    """The ops of the complete frames at the start of `buf`, and how many bytes they took."""
    ops: list[tuple[int, str, str, float, bytes]] = []
    at, end = 0, len(buf)
    with memoryview(buf) as view:
        while end - at >= FRAME.size:
            (n,) = FRAME.unpack_from(view, at)
            if end - at - FRAME.size < n:
                break
            ops += _ops.decode(view[at + FRAME.size:at + FRAME.size + n])
            at += FRAME.size + n
    return ops, at


def run(sock: socket.socket, writer: _Writer) -> None:
    """Commit what arrives until the input ends; acknowledge each transaction."""
    buf = bytearray()
    ended = False
    while not ended:
        chunk = sock.recv(_READ)
        ended = not chunk
        buf += chunk
        while not ended:  # everything sent while the last transaction synced: one transaction
            try:
                chunk = sock.recv(_READ, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            ended = not chunk
            buf += chunk
        ops, used = _frames(buf)
        del buf[:used]
        if not ops:
            continue
        error = writer.commit(ops)
        text = b"" if error is None else error.encode("utf-8", "replace")
        sock.sendall(ACK.pack(len(ops), time.process_time(), len(text)) + text)


class WriterProcess:
    """`serve`'s end of the writer: starts it, sends it ops, and reads its acks on the
    event loop (`add_reader`, no thread): `on_ack(n, cpu_s, error)` per transaction,
    then `on_end(why)` once when the socket closes (the writer exited or died)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, path: Path, *, max_bytes: int | None, sync: str,
                 tombstone_ttl_s: float,
                 lock_fd: int, on_ack: Callable[[int, float, str | None], None],
                 on_end: Callable[[str], None]) -> None:
        self._loop, self._on_ack, self._on_end = loop, on_ack, on_end
        mine, theirs = socket.socketpair()
        try:
            with theirs:
                # from the loop thread: the writer's death signal follows the thread that started it;
                # its own session: a Ctrl-C or a supervisor's SIGTERM to `serve`'s process group
                # must not end it before `serve` has drained (it ends on EOF, or with `serve`)
                self.proc = spawn(__name__, [str(theirs.fileno()), str(path), str(max_bytes or 0), sync,
                                             repr(tombstone_ttl_s), str(os.getpid())],
                                  pass_fds=(theirs.fileno(), lock_fd))
        except BaseException:
            mine.close()
            raise
        mine.setblocking(False)
        self._sock: socket.socket | None = mine
        self._out: collections.deque[memoryview] = collections.deque()  # what the socket did not take yet
        self._finish = False
        self._blocked = False  # the socket is full: `_flush` runs when it is writable again
        self._acks = bytearray()
        loop.add_reader(mine.fileno(), self._readable)

    @staticmethod
    def frame(ops: list[Op]) -> bytes:
        """`ops` as one frame (raises what msgpack cannot encode: nothing is sent then)."""
        payload = _encode(ops)
        return FRAME.pack(len(payload)) + payload

    def send(self, frame: bytes) -> None:
        """One frame (`frame`), in order after every earlier one."""
        if self._sock is None:
            return  # ended: `on_end` failed what was waiting
        self._out.append(memoryview(frame))
        if len(self._out) == 1:  # nothing was queued before it: send now
            self._flush()

    def finish(self) -> None:
        """No more ops: the writer commits what it has, acknowledges it and exits."""
        self._finish = True
        if not self._out:
            self._shut()

    def _flush(self) -> None:
        """Send what is queued; what the socket does not take waits for it to be writable."""
        sock = self._sock
        if sock is None:
            return
        while self._out:
            head = self._out[0]
            try:
                sent = sock.send(head)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._failed(exc)
                return
            if sent < len(head):
                self._out[0] = head[sent:]
                if not self._blocked:
                    self._blocked = True
                    self._loop.add_writer(sock.fileno(), self._flush)
                return
            self._out.popleft()
        if self._blocked:
            self._blocked = False
            self._loop.remove_writer(sock.fileno())
        if self._finish:
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self._end(f"the writer process's socket failed: {exc}")

    def _readable(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            data = sock.recv(_READ)
        except BlockingIOError:
            return
        except OSError as exc:
            self._failed(exc)
            return
        if not data:
            self._end("the writer process ended")
            return
        acks = self._acks
        acks += data
        at = 0
        while len(acks) - at >= ACK.size:
            n, cpu_s, elen = ACK.unpack_from(acks, at)
            if len(acks) - at - ACK.size < elen:
                break
            error = bytes(acks[at + ACK.size:at + ACK.size + elen]).decode("utf-8", "replace") if elen else None
            at += ACK.size + elen
            self._on_ack(n, cpu_s, error)
        del acks[:at]

    def _end(self, why: str) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._loop.remove_reader(sock.fileno())
        self._loop.remove_writer(sock.fileno())
        sock.close()
        self._out.clear()
        status = self.proc.poll()
        self._on_end(why if status is None else f"{why} (exit status {status})")

    def kill(self) -> None:
        """End the writer now (its socket then closes: `on_end`)."""
        if self.proc.poll() is None:
            self.proc.kill()

    async def wait(self, timeout_s: float = 30.0) -> None:
        """Until the process exited (killed after `timeout_s`)."""
        try:
            await asyncio.wait_for(self._loop.run_in_executor(None, self.proc.wait), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await self._loop.run_in_executor(None, self.proc.wait)


def main(argv: list[str]) -> int:
    """`python -m session_server.journal_writer FD PATH MAX_BYTES SYNC TTL_S PARENT_PID`
    (MAX_BYTES 0: no quota). Run by `Journal.start`, never by hand."""
    from .parent_death import die_with_parent

    fd, path, max_bytes, sync, ttl_s, parent = argv
    ignore_interrupts()  # ends on EOF (`Journal.close`) or with `serve` (below)
    die_with_parent(int(parent))
    sock = socket.socket(fileno=int(fd))
    conn = connect(Path(path), int(max_bytes) or None, sync)
    try:
        run(sock, _Writer(conn, float(ttl_s)))
    finally:
        conn.close()  # the last connection checkpoints the WAL into the file
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
