"""A `kill -9` of `serve` or of `cluster` leaves no process behind: the reply worker
dies with `serve`; HAProxy and every worker (and theirs) die with `cluster`
(session_server/parent_death.py). Linux only: the processes are read from /proc."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from session_server.ops.cluster import free_ports
from session_server.parent_death import die_with_parent_argv

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads processes from /proc (Linux)")

START_S = 180.0  # two shared cores: a serve process takes seconds to load its tokenizer
GONE_S = 5.0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid`: pid -> command line."""
    found: dict[int, str] = {}
    todo = _children(pid)
    while todo:
        child = todo.pop()
        if child in found:
            continue
        with contextlib.suppress(OSError):
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            todo += _children(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for an init that does not reap counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_for(what: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


@contextlib.contextmanager
def started(argv: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[int, str]]]:
    """`argv` as a subprocess; yields it and a dict the test fills with its descendants,
    each of which is killed at the end if it is still alive (by its pid)."""
    seen: dict[int, str] = {}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    try:
        yield proc, seen
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in seen:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def serve_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "session_server.ops.cli", "serve", "--engine", "sglang=http://127.0.0.1:9",
            "--tokenizer", "qwen3", "--host", "127.0.0.1", "--port", str(port), "--cpu-workers", "1",
            "--log-level", "warning", *extra]


def _has_reply_worker(procs: dict[int, str]) -> bool:
    """The reply worker is up (engines/reply_worker.py)."""
    return any("session_server.engines.reply_worker" in c for c in procs.values())


def _assert_all_die(proc: subprocess.Popen[bytes], seen: dict[int, str], log: Path) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not any(alive(p) for p in seen), GONE_S,
             lambda: f"left running after kill -9: {[(p, c[:120]) for p, c in seen.items() if alive(p)]}\n"
                     f"{log.read_text(errors='replace')[-2000:]}")


def test_kill_9_of_serve_takes_its_reply_worker_with_it(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with started(serve_argv(free_ports(1)[0], "--decode-processes", "1"), log) as (proc, seen):
        def pool_up() -> bool:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            seen.update(descendants(proc.pid))
            return _has_reply_worker(seen)

        wait_for(pool_up, START_S, lambda: f"no reply worker: {seen}\n{log.read_text(errors='replace')[-2000:]}")
        _assert_all_die(proc, seen, log)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_kill_9_of_cluster_takes_haproxy_every_worker_and_their_children_with_it(tmp_path: Path) -> None:
    log = tmp_path / "cluster.log"
    argv = [sys.executable, "-m", "session_server.ops.cli", "cluster", "--workers", "2", "--port", str(free_ports(1)[0]),
            "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3", "--cpu-workers", "1",
            "--decode-processes", "1", "--log-level", "info", "--drain-timeout-s", "2",
            "--journal-dir", str(tmp_path / "journal")]
    with started(argv, log) as (proc, seen):
        def ready() -> bool:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            if "cluster ready" not in log.read_text(errors="replace"):
                return False
            seen.update(descendants(proc.pid))
            workers = [p for p, c in seen.items() if "session_server.ops.cli serve" in c]
            return (any("haproxy" in c for c in seen.values()) and len(workers) == 2
                    and all(_has_reply_worker(descendants(w)) for w in workers))

        wait_for(ready, START_S, lambda: f"cluster not up: {seen}\n{log.read_text(errors='replace')[-2000:]}")
        seen.update(descendants(proc.pid))
        _assert_all_die(proc, seen, log)


def test_the_exec_wrapper_keeps_the_pid_and_the_exit_status(tmp_path: Path) -> None:
    """The wrapped command replaces the wrapper (the pid `cluster` reports is the
    worker's), and a command that ends by itself reports its own status."""
    done = subprocess.run(die_with_parent_argv([sys.executable, "-c", "import os, sys; print(os.getpid()); sys.exit(3)"]),
                          capture_output=True, text=True, check=False)
    assert done.returncode == 3 and done.stdout.strip().isdigit()
    p = subprocess.Popen(die_with_parent_argv([sys.executable, "-c", "import os; print(os.getpid())"]),
                         stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=30)
    assert int(out) == p.pid
