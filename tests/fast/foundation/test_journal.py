"""The journal's storage: durable appends with group commit, what a crash or a damaged
file does to it (a torn last write dropped with a warning, a bad record refusing to
start), a full disk answering an error, tombstones, one writer per file."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from session_server import journal
from session_server.errors import JournalUnavailable, SessionGone
from session_server.journal import Journal, JournalCorrupt, Written, durable, journal_path, settled
from session_server.journal_file import connect
from session_server.journal_writer import FRAME


async def _open(path: Path, **kw: object) -> Journal:
    j = Journal(path, **kw)  # type: ignore[arg-type]
    list(j.read())
    j.start(asyncio.get_running_loop())
    return j


async def test_appends_come_back_in_order_with_their_bodies(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    futs = [j.append(f"s{i % 3}", "turn", bytes([i]) * (i + 1)) for i in range(50)]
    await asyncio.gather(*futs)
    await j.close()
    rows = list(Journal(path).read())
    assert [(r.sid, r.kind, r.body) for r in rows] == [(f"s{i % 3}", "turn", bytes([i]) * (i + 1)) for i in range(50)]
    assert [r.seq for r in rows] == sorted(r.seq for r in rows)


async def test_records_queued_together_share_one_sync(tmp_path: Path) -> None:
    j = await _open(journal_path(tmp_path, "w0"))
    await asyncio.gather(*[j.append("s", "turn", b"x") for _ in range(200)])
    assert j.records_written == 200
    assert j.syncs < 200  # group commit: the loop queued them faster than one fsync each
    await j.close()


async def test_a_torn_last_write_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A crash mid-write leaves the WAL ending inside a frame: SQLite ignores the
    unfinished transaction (never acknowledged) and the start says so."""
    path = journal_path(tmp_path / "live", "w0")
    j = await _open(path)
    for i in range(5):  # one transaction each
        await j.append("s", "turn", f"record {i}".encode() * 50)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal"):  # the files as a kill -9 leaves them (the writer still holds them)
        shutil.copy(str(path) + suffix, str(crashed / path.name) + suffix)
    await j.close()
    wal = crashed / (path.name + "-wal")
    assert wal.stat().st_size > 0
    with wal.open("r+b") as f:
        f.truncate(wal.stat().st_size - 100)  # the last frame loses its end
    with caplog.at_level(logging.WARNING, logger="session_server"):
        rows = list(Journal(crashed / path.name).read())
    assert "torn" in caplog.text
    bodies = [r.body for r in rows]
    assert bodies == [f"record {i}".encode() * 50 for i in range(len(bodies))]
    assert len(bodies) == 4  # the torn one is gone, every earlier one is intact


async def test_a_record_damaged_on_disk_stops_the_start_naming_it(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    await j.append("s1", "create", b"fine")
    await j.append("s1", "turn", b"MARKER-" + b"x" * 64)
    await j.close()  # the last connection checkpoints: the record lives in the main file now
    data = bytearray(path.read_bytes())
    at = data.index(b"MARKER-")
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=r"record 2 \(turn of session 's1'\) fails its checksum"):
        list(Journal(path).read())


async def test_a_file_that_is_not_a_database_stops_the_start(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    path.write_bytes(b"this is not sqlite" * 200)
    with pytest.raises(JournalCorrupt, match="w0.sqlite3"):
        list(Journal(path).read())


async def test_a_full_disk_fails_the_write_and_then_refuses_new_work(tmp_path: Path) -> None:
    """SQLite's SQLITE_FULL (a full volume, or the quota here) fails the records of that
    transaction; for a while afterwards new work is refused up front."""
    j = await _open(journal_path(tmp_path, "w0"), max_bytes=65536)
    j.check_writable()
    with pytest.raises(JournalUnavailable, match="full"):
        for _ in range(200):
            await j.append("s", "turn", b"y" * 8192)
    with pytest.raises(JournalUnavailable, match="cannot be written"):
        j.check_writable()
    await j.close()


async def test_a_writer_that_fails_for_a_reason_not_sqlites_fails_what_waits_and_every_later_change(
        tmp_path: Path) -> None:
    """An error that is not SQLite's inside the writer (a bug: here a frame it cannot
    decode) ends the writer process: the change waiting on it is answered with the
    journal's error (a 503 at the API), never left waiting, and so is every later one
    (the file may hold what was sent unanswered: only a restart's replay may serve it)."""
    j = await _open(journal_path(tmp_path, "w0"))
    await j.append("s", "turn", b"kept")
    writer = j._writer
    assert writer is not None and writer._sock is not None
    writer._sock.send(FRAME.pack(2) + b"\xc1\xc1")  # 0xc1: a byte msgpack never uses
    done, _ = await asyncio.wait({j.append("s", "turn", b"lost")}, timeout=30)  # `Written` cannot be cancelled
    assert done, "the change was never answered"
    with pytest.raises(JournalUnavailable, match="could not store this change"):
        done.pop().result()
    with pytest.raises(JournalUnavailable):
        await j.append("s", "turn", b"later")
    with pytest.raises(JournalUnavailable, match="until it restarts"):
        j.check_writable()
    await j.close()
    assert [r.body for r in Journal(journal_path(tmp_path, "w0")).read()] == [b"kept"]


async def test_tombstones_answer_gone_and_survive_a_restart(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    await j.append("s1", "create", b"c")
    await j.append("s1", "turn", b"t")
    await j.append("s2", "create", b"c")
    await j.gone("s1", "closed by DELETE")
    with pytest.raises(SessionGone, match="closed by DELETE"):
        j.check_gone("s1")
    j.check_gone("s2")  # alive: no answer
    await j.close()
    again = Journal(path)
    assert [r.sid for r in again.read()] == ["s2"]  # the closed session's records are compacted away
    with pytest.raises(SessionGone):
        again.check_gone("s1")
    again.release()


async def test_tombstones_expire(tmp_path: Path) -> None:
    j = await _open(journal_path(tmp_path, "w0"), tombstone_ttl_s=0.0)
    await j.gone("s1", "expired (ttl)")
    await asyncio.sleep(0.01)
    j.check_gone("s1")  # past its time: an unknown id again (404 upstream)
    await j.close()


async def test_one_process_per_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal, "LOCK_WAIT_S", 0.2)
    path = journal_path(tmp_path, "w0")
    first = Journal(path)
    with pytest.raises(JournalCorrupt, match="in use by another process"):
        Journal(path)
    first.release()
    Journal(path).release()


def test_a_restart_waits_for_the_lock_of_a_writer_that_is_still_ending(tmp_path: Path) -> None:
    """The writer process of a killed instance holds the lock until the kernel ends it
    too: the restarted instance waits for it instead of refusing to start."""
    path = journal_path(tmp_path, "w0")
    first = Journal(path)
    threading.Timer(0.3, first.release).start()
    t0 = time.monotonic()
    Journal(path).release()
    assert time.monotonic() - t0 >= 0.25


async def test_stored_rows_are_plain_sqlite(tmp_path: Path) -> None:
    """The file is a standard SQLite database an operator can inspect."""
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    await j.append("s1", "create", b"c")
    await j.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT sid, kind FROM records").fetchall() == [("s1", "create")]


async def test_a_cancel_waits_for_the_outcome_of_the_write() -> None:
    """A turn cancelled while its record is written learns the outcome first: stored, the
    commit stands (then the cancel goes on); failed, the error decides."""
    loop = asyncio.get_running_loop()
    ok, bad = Written(loop=loop), Written(loop=loop)
    assert not ok.cancel()
    got: list[object] = []

    async def wait(w: Written) -> None:
        try:
            got.append(await settled(w))
        except JournalUnavailable as exc:
            got.append(exc)

    tasks = [asyncio.create_task(wait(w)) for w in (ok, bad)]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.sleep(0.01)
    assert got == [] and not any(t.done() for t in tasks)  # still waiting for the outcome
    ok.set_result(None)
    bad.set_exception(JournalUnavailable("disk full"))
    await asyncio.gather(*tasks)
    assert got[0] is True and isinstance(got[1], JournalUnavailable)
    with pytest.raises(asyncio.CancelledError):
        w = Written(loop=loop)
        t = asyncio.create_task(durable(w))
        await asyncio.sleep(0)
        t.cancel()
        w.set_result(None)
        await t


@pytest.mark.parametrize("sync, pragma", [("full", 2), ("normal", 1)])
async def test_the_journal_runs_with_the_sync_mode_it_was_given(tmp_path: Path, sync: str, pragma: int) -> None:
    """The writer process opens the file with the mode (its command line carries it, and
    the file helper it opens with sets that pragma)."""
    path = journal_path(tmp_path, "w0")
    j = await _open(path, sync=sync)
    await j.append("s", "turn", b"x")
    argv = Path(f"/proc/{j.writer_pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"session_server.journal_writer") + 4].decode() == sync
    await j.close()
    conn = connect(path, None, sync)
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == pragma
    conn.close()


def test_a_sync_mode_whose_machine_crash_could_corrupt_the_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown journal sync 'off'"):
        Journal(journal_path(tmp_path, "w0"), sync="off")


def test_the_setting_reaches_the_journal(tmp_path: Path) -> None:
    from session_server.durability import open_journal
    from session_server.settings import Settings

    j = open_journal(Settings(journal_dir=str(tmp_path), journal_sync="normal"))
    assert j is not None and j.sync == "normal"
    j.release()
    j = open_journal(Settings(journal_dir=str(tmp_path)))
    assert j is not None and j.sync == "full"
    j.release()
    with pytest.raises(ValueError, match="unknown journal sync 'off'; choose from full, normal"):
        Settings(journal_sync="off")


KILLED_WRITER = """
import asyncio, os, signal, sys
from pathlib import Path
from session_server.journal import Journal, durable

async def main() -> None:
    j = Journal(Path(sys.argv[1]), sync=sys.argv[2])
    list(j.read())
    j.start(asyncio.get_running_loop())
    for i in range(40):
        await durable(j.append(f"s{i % 4}", "turn", f"turn {i}".encode() * 40))
    print("acknowledged 40", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint: the process dies

asyncio.run(main())
"""


@pytest.mark.parametrize("sync", ["full", "normal"])
def test_every_acknowledged_change_survives_a_killed_process_in_either_sync_mode(tmp_path: Path, sync: str) -> None:
    import subprocess
    import sys

    path = journal_path(tmp_path, "w0")
    out = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path), sync], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -9 and "acknowledged 40" in out.stdout, out.stderr
    rows = list(Journal(path).read())
    assert [r.body for r in rows] == [f"turn {i}".encode() * 40 for i in range(40)]
