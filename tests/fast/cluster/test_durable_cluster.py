"""Durable sessions in a cluster: a worker killed with SIGKILL mid-run (or only its
journal's writer process, which ends the worker) is restarted by `session-server
cluster`, replays its journal (on by default) and its agents finish their episodes
through the proxy, with the same samples as a run without the crash (the episodes and
the check are the single-server crash test's)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from session_server.sim import running_sim

from ..e2e.test_durable_sessions import SESSIONS, _episodes, serving
from .test_cluster import needs_haproxy, running_cluster


def _journal_writer(worker: int) -> int:
    """The pid of `worker`'s journal writer process (its child running journal_writer)."""
    for task in Path(f"/proc/{worker}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"session_server.journal_writer" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"worker {worker} has no journal writer")


@needs_haproxy
@pytest.mark.parametrize("victim", ["worker", "journal writer"])
async def test_a_killed_worker_comes_back_with_its_sessions_and_identical_samples(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, victim: str,
) -> None:
    """Killing only the writer must end the worker (status 70): its sessions may lack a
    change the file holds, so it must not commit again before a replay."""
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=11, latency_ms=4.0) as engine:
        async with serving(qwen3, engine, tmp_path / "j-clean", tmp_path / "clean.log") as clean:
            expected = await _episodes(clean.url)

    async with running_sim("sglang", str(qwen3), seed=11, latency_ms=4.0) as engine, \
            running_cluster(qwen3, engine, 2, tmp_path, "--restart-backoff-s", "0.5") as cl:
        killed: list[int] = []

        async def crash(done: int) -> None:
            if done >= SESSIONS * 2 // 5 and not killed:
                pid = cl.workers["w0"][0]
                killed.append(pid)
                if victim == "journal writer":  # the worker sees it die and exits
                    pid = _journal_writer(pid)
                os.kill(pid, signal.SIGKILL)  # its turns in flight fail; the agents retry through the proxy

        got = await _episodes(cl.url, crash)
        log = cl.log_text()
    assert killed and "worker w0 restarted" in log, log[-3000:]
    if victim == "journal writer":
        assert "writer process died" in log and "status 70" in log, log[-3000:]
    assert "its sessions wait in its journal" in log
    different = [k for k in expected if expected[k] != got[k]]
    assert not different, (f"{len(different)} sessions differ, e.g. {different[0]}:\n"
                           f"{expected[different[0]][:600]!r}\n{got[different[0]][:600]!r}")
