"""`session-server serve` with a loop-lag watch, for benchmarks that must tell the
server's own stalls from the machine's (bench/routing_replay.py).

    LOOPWATCH_FILE=/tmp/lag.txt python bench/_loopwatch.py serve ...

A task on the server's event loop sleeps `INTERVAL_S` and writes one line per wake-up:
``wall_time lag_ms on_cpu_ms runqueue_ms``, the last two the loop thread's own time
on a CPU and waiting for one over that tick (/proc/thread-self/schedstat). A tick
that overran by `lag` was spent on a CPU (the loop's own callbacks), waiting on the
run queue (the machine's other processes) or blocked, which for a loop thread
between epoll wake-ups means waiting for the GIL that another thread holds.
`summary` reads the file back over a time window.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 0.002
STALL_MS = 10.0


async def _watch(path: str) -> None:
    """Sample the loop's lag forever, flushing every quarter second."""
    sched = open("/proc/thread-self/schedstat", "rb", buffering=0)  # noqa: SIM115 (lives with the loop)

    def times() -> tuple[int, int]:
        sched.seek(0)
        run, wait, _ = sched.read(128).split()
        return int(run), int(wait)

    with open(path, "a", buffering=1) as out:
        buf: list[str] = []
        run0, wait0 = times()
        flushed = time.monotonic()
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(INTERVAL_S)
            lag_ms = (time.perf_counter() - t0 - INTERVAL_S) * 1e3
            run1, wait1 = times()
            buf.append(f"{time.time():.4f} {lag_ms:.3f} {(run1 - run0) / 1e6:.3f} {(wait1 - wait0) / 1e6:.3f}\n")
            run0, wait0 = run1, wait1
            if time.monotonic() - flushed > 0.25:
                out.write("".join(buf))
                buf.clear()
                flushed = time.monotonic()


def _install(path: str) -> None:
    """Start `_watch` on uvicorn's loop when the server starts serving."""
    import uvicorn

    serve = uvicorn.Server.serve

    async def watched(self: Any, sockets: Any = None) -> None:
        task = asyncio.get_running_loop().create_task(_watch(path))
        try:
            await serve(self, sockets)
        finally:
            task.cancel()

    uvicorn.Server.serve = watched  # type: ignore[method-assign]


def summary(path: Path, t0: float, t1: float) -> dict[str, Any]:
    """Loop lag over ``[t0, t1]`` (wall clock): p50/p99/max of the ticks' lag, and the
    time lost in stalls over `STALL_MS`, split into on-CPU (the loop's own work), run
    queue (the machine) and blocked (the GIL)."""
    import numpy as np

    rows = np.array([[float(x) for x in line.split()] for line in path.read_text().splitlines() if line.strip()])
    if rows.size:
        rows = rows[(rows[:, 0] >= t0) & (rows[:, 0] <= t1)]
    if not rows.size:
        return {}
    lag = rows[:, 1]
    big = rows[lag > STALL_MS]
    wall = big[:, 1] + INTERVAL_S * 1e3
    return {"ticks": len(rows), "p50": round(float(np.percentile(lag, 50)), 2),
            "p99": round(float(np.percentile(lag, 99)), 2), "max": round(float(lag.max()), 2),
            "stalls": len(big), "stalled_ms": round(float(big[:, 1].sum()), 1),
            "stalled_on_cpu_ms": round(float(big[:, 2].sum()), 1),
            "stalled_runqueue_ms": round(float(big[:, 3].sum()), 1),
            "stalled_blocked_ms": round(float(np.clip(wall - big[:, 2] - big[:, 3], 0, None).sum()), 1)}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's session_server
    if len(sys.argv) > 1 and sys.argv[1] == "serve" and os.environ.get("LOOPWATCH_FILE"):
        _install(os.environ["LOOPWATCH_FILE"])
    from session_server.ops.cli import main

    sys.exit(main())
