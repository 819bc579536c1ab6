"""Start the server and simulated engines as separate processes for benchmarks.

Benchmarks measure the server, so the simulator must not share its event loop
or GIL: each runs as its own `session-server` process on a free 127.0.0.1 port,
and is always terminated.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from session_server.ops.harness import free_port

CLI = [sys.executable, "-m", "session_server.ops.cli"]
TICKS = os.sysconf("SC_CLK_TCK")
PIDS: dict[str, int] = {}  # url -> pid of the process serving it (peak RSS from /proc)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


@contextlib.contextmanager
def process(args: Sequence[str], url: str, log_path: Path | None = None, nice: int = 0,
            cli: Sequence[str] = CLI) -> Iterator[str]:
    """`nice` > 0 lowers the process's CPU priority (used for what stands in for other machines);
    `cli` is the command `args` go to (bench/_loopwatch.py wraps the server's)."""
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    priority = (lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)) if nice else None
    proc = subprocess.Popen(
        [*cli, *args], stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(), preexec_fn=priority
    )
    PIDS[url] = proc.pid
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        PIDS.pop(url, None)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def sim_engine(
    protocol: str, tokenizer: str, *, dp: int = 1, latency_ms: float = 0.0, extra: Sequence[str] = (), nice: int = 0
) -> Iterator[str]:
    port = free_port()
    args = ["sim-engine", "--protocol", protocol, "--tokenizer", tokenizer, "--port", str(port),
            "--dp", str(dp), "--latency-ms", str(latency_ms), *extra]
    with process(args, f"http://127.0.0.1:{port}", nice=nice) as url:
        yield url


@contextlib.contextmanager
def server(engines: Sequence[str], tokenizer: str, *, extra: Sequence[str] = (),
           cli: Sequence[str] = CLI) -> Iterator[str]:
    port = free_port()
    args = ["serve", "--tokenizer", tokenizer, "--port", str(port), "--log-level", "warning", *extra]
    for e in engines:
        args += ["--engine", e]
    with process(args, f"http://127.0.0.1:{port}", cli=cli) as url:
        yield url


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process (seconds); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (every thread's), from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...): a helper's own helpers
    count as the server's too."""
    out: list[int] = []
    stack = children(pid)
    while stack:
        p = stack.pop()
        out.append(p)
        stack += children(p)
    return out
