"""The journal's writer process: a writer that dies fails what waits for it and every
later change (never an acknowledgement it did not give), its acknowledged records stay
in the file, and it dies with the process that started it, freeing the journal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from session_server import journal_writer
from session_server.errors import JournalUnavailable
from session_server.journal import Journal, journal_path

from ..ops.test_parent_death import alive as _alive
from .test_journal import _open

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")

GONE_S = 10.0


async def test_a_killed_writer_fails_the_change_waiting_for_it_and_every_later_one(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    await j.append("s1", "create", b"acknowledged")
    pid = j.writer_pid
    assert pid is not None and _alive(pid)
    os.kill(pid, signal.SIGSTOP)  # the writer holds the next record without committing it
    waiting = j.append("s1", "turn", b"never acknowledged")
    await asyncio.sleep(0.05)  # handed over: the frame sits in the writer's socket
    assert not waiting.done()
    os.kill(pid, signal.SIGKILL)
    await asyncio.wait({waiting}, timeout=GONE_S)  # (wait_for would wait for ever: a `Written` cannot be cancelled)
    assert waiting.done(), "a change sent to a dead writer is still waiting"
    with pytest.raises(JournalUnavailable, match="writer process"):
        waiting.result()
    with pytest.raises(JournalUnavailable, match="writer process"):
        await j.append("s2", "create", b"after the death")
    with pytest.raises(JournalUnavailable, match="until it restarts"):
        j.check_writable()
    assert j.dead is not None
    deadline = time.monotonic() + GONE_S  # (its socket closes a moment before it is a zombie)
    while _alive(pid):
        assert time.monotonic() < deadline, f"writer {pid} still runs"
        await asyncio.sleep(0.01)
    await j.close()  # reaps the writer, frees the file
    assert [r.body for r in Journal(path).read()] == [b"acknowledged"]


async def test_acks_of_frames_the_writer_merged_settle_each_change_in_order(tmp_path: Path) -> None:
    """Frames sent over several loop ticks while the writer stands still reach it as
    one read: one transaction, one ack for all of them, and each change is settled."""
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    await j.append("s", "create", b"first")
    pid = j.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        futs = []
        for tick in range(5):  # five hand-overs: five frames queued in the socket
            futs += [j.append(f"s{tick}", "turn", b"%d.%d" % (tick, i)) for i in range(3)]
            futs.append(j.barrier())
            await asyncio.sleep(0.005)
        syncs = j.syncs
        assert not any(f.done() for f in futs)
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.wait(set(futs), timeout=GONE_S)
    assert all(f.done() and f.exception() is None for f in futs)
    assert j.syncs - syncs <= 2  # merged: not one transaction per frame
    await j.close()
    assert [r.body for r in Journal(path).read()] == [b"first"] + [b"%d.%d" % (t, i) for t in range(5) for i in range(3)]


async def test_a_signal_to_serves_process_group_does_not_end_the_writer(tmp_path: Path) -> None:
    """A Ctrl-C or a supervisor's SIGTERM to `serve`'s group would end a writer in the
    middle of `serve`'s drain: it runs in its own session and ignores both."""
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    pid = j.writer_pid
    assert pid is not None and os.getsid(pid) != os.getsid(0)
    await j.append("s", "create", b"before")
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(pid, sig)
    await asyncio.sleep(0.2)
    await j.append("s", "turn", b"after")
    assert j.dead is None and _alive(pid)
    await j.close()
    assert [r.body for r in Journal(path).read()] == [b"before", b"after"]


async def test_a_writer_that_cannot_be_started_leaks_nothing_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_process(*args: object, **kw: object) -> None:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(journal_writer, "spawn", no_process)
    j = Journal(journal_path(tmp_path, "w0"))
    list(j.read())
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="temporarily unavailable"):
        j.start(asyncio.get_running_loop())
    assert len(os.listdir("/proc/self/fd")) == fds  # its socket pair closed
    j.release()


async def test_an_ended_input_commits_what_was_sent_before_the_writer_exits(tmp_path: Path) -> None:
    """`close` right after appends nobody awaited: the writer commits them, acknowledges
    them and exits, and the file holds them all."""
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    futs = [j.append("s", "turn", b"%d" % i) for i in range(100)]
    await j.close()
    assert all(f.done() and f.exception() is None for f in futs)
    assert [r.body for r in Journal(path).read()] == [b"%d" % i for i in range(100)]


async def test_a_record_too_big_for_the_socket_buffer_is_written_whole(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    j = await _open(path)
    big = bytes(range(256)) * 40_000  # ~10 MB: many sends, the rest queued until the socket drains
    await asyncio.gather(j.append("s", "turn", big), j.append("s", "turn", b"after"))
    await j.close()
    assert [r.body for r in Journal(path).read()] == [big, b"after"]


_PARENT = """
import asyncio, sys
from pathlib import Path
from session_server.journal import Journal

async def main():
    j = Journal(Path(sys.argv[1]))
    list(j.read())
    j.start(asyncio.get_running_loop())
    await j.append("s1", "create", b"acknowledged")
    print(j.writer_pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_the_writer_dies_with_its_parent_and_frees_the_journal(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "w0")
    root = str(Path(__file__).resolve().parents[3])
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": root})
    try:
        assert parent.stdout is not None
        writer = int(parent.stdout.readline())
        assert _alive(writer)
        os.kill(writer, signal.SIGSTOP)  # stopped, it cannot see its input end: only the kernel's signal ends it
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + GONE_S
        while _alive(writer):
            assert time.monotonic() < deadline, f"writer {writer} outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if "writer" in locals() and _alive(writer):  # the kernel did not end it: do it here
            os.kill(writer, signal.SIGKILL)
    again = Journal(path)  # the lock is free: no writer of the old instance is left
    assert [r.body for r in again.read()] == [b"acknowledged"]
    again.release()
