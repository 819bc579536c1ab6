"""Concurrency sweep: one turn per session at 500 ... 10,000 concurrent sessions.

Server and simulated engine run as separate processes; the engine answers every
request after `--engine-latency-s` (0.5 s). Per level: errors by kind, wall time,
turns/s, p50/p99 turn latency, and the peak number of open TCP connections from
the server to the engine (sampled from /proc/net/tcp), which must stay bounded
by the per-engine cap however many agents connect.

Errors are counted per phase (create / chat / delete) by exception class or
HTTP status, with the machine's TCP counters (ListenOverflows and friends from
/proc/net/netstat and /proc/net/snmp) before and after each level. `--cpu-hog N`
runs N busy-looping processes beside the server for the whole run: production
rollout hosts share the CPU with agents, sandboxes and tools.

    python bench/load_test.py --json bench/results/load_test.json [--levels 500,1000] [--cpu-hog 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import server, sim_engine  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Run the task."}], "max_tokens": 8}


def _engine_connections(port: int) -> tuple[int, int]:
    """(server side, engine side): ESTABLISHED sockets whose remote port is the
    engine's (the server's outbound connections) and whose local port is (the
    engine's accepted ones, which can lag while it closes idle connections)."""
    outbound = accepted = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "01":
                continue
            outbound += int(parts[2].rsplit(":", 1)[1], 16) == port
            accepted += int(parts[1].rsplit(":", 1)[1], 16) == port
    return outbound, accepted


async def _sample_conns(port: int, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        outbound, accepted = await asyncio.to_thread(_engine_connections, port)
        peak[0], peak[1] = max(peak[0], outbound), max(peak[1], accepted)
        await asyncio.sleep(0.05)


# TcpExt (/proc/net/netstat) and Tcp (/proc/net/snmp) counters that tell who
# dropped or closed connections: a full accept queue (ListenOverflows/Drops), a
# reset sent or received (OutRsts, EstabResets, TCPAbortOn*). Machine-wide.
TCP_COUNTERS = ("ListenOverflows", "ListenDrops", "TCPAbortOnData", "TCPAbortOnClose",
                "TCPAbortOnTimeout", "EstabResets", "OutRsts", "AttemptFails")


def _tcp_counters() -> dict[str, int]:
    """Read TCP_COUNTERS from the header/value line pairs of /proc/net/{netstat,snmp}."""
    found: dict[str, int] = {}
    for table in ("/proc/net/netstat", "/proc/net/snmp"):
        try:
            lines = Path(table).read_text().splitlines()
        except OSError:
            continue
        for head, values in zip(lines[::2], lines[1::2], strict=False):
            for name, value in zip(head.split()[1:], values.split()[1:], strict=False):
                if name in TCP_COUNTERS and value.lstrip("-").isdigit():
                    found[name] = int(value)
    return found


def _spin() -> None:
    """Burn one core in pure Python until terminated."""
    while True:
        pass


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """N busy-looping processes for the block's duration, always terminated."""
    procs = [multiprocessing.Process(target=_spin, daemon=True, name=f"cpu-hog-{i}") for i in range(n)]
    try:
        for p in procs:
            p.start()
        yield
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)


class _Errors:
    """Error counts per phase, keyed by exception class or HTTP status."""

    def __init__(self) -> None:
        self.by_phase: dict[str, dict[str, int]] = {"create": {}, "chat": {}, "delete": {}}

    def add(self, phase: str, kind: str) -> None:
        self.by_phase[phase][kind] = self.by_phase[phase].get(kind, 0) + 1

    def total(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.by_phase.values())

    def merged(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kinds in self.by_phase.values():
            for kind, count in kinds.items():
                out[kind] = out.get(kind, 0) + count
        return out


async def _level(url: str, engine_port: int, n: int) -> dict[str, Any]:
    errors = _Errors()
    counters_before = _tcp_counters()
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        sem = asyncio.Semaphore(512)

        async def create() -> str | None:
            try:
                async with sem, http.post(f"{url}/sessions", json={}) as r:
                    if not 200 <= r.status < 300:
                        await r.read()
                        errors.add("create", str(r.status))
                        return None
                    return str((await r.json())["session_id"])
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors.add("create", type(exc).__name__)
                return None

        sids = [s for s in await asyncio.gather(*(create() for _ in range(n))) if s is not None]
        latencies: list[float] = []

        async def chat(sid: str) -> None:
            t0 = time.perf_counter()
            try:
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=CHAT) as r:
                    await r.read()
                    if r.status != 200:
                        errors.add("chat", str(r.status))
                        return
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors.add("chat", type(exc).__name__)
                return
            latencies.append(time.perf_counter() - t0)

        stop = asyncio.Event()
        peak = [0, 0]
        sampler = asyncio.create_task(_sample_conns(engine_port, stop, peak))
        t0 = time.perf_counter()
        await asyncio.gather(*(chat(s) for s in sids))
        wall = time.perf_counter() - t0
        stop.set()
        await sampler

        async def delete(sid: str) -> None:
            try:
                async with sem, http.delete(f"{url}/sessions/{sid}") as r:
                    await r.read()
                    if not 200 <= r.status < 300:
                        errors.add("delete", str(r.status))
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors.add("delete", type(exc).__name__)

        await asyncio.gather(*(delete(s) for s in sids))
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    counters_after = _tcp_counters()
    return {
        "concurrency": n,
        "errors": errors.total(),
        "errors_by_kind": errors.merged(),
        "errors_by_phase": errors.by_phase,
        "tcp_counter_deltas": {k: counters_after[k] - counters_before[k] for k in counters_after if k in counters_before},
        "wall_s": wall,
        "turns_per_s": len(latencies) / wall,
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "peak_engine_connections": peak[0],
        "peak_engine_accepted_connections": peak[1],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--levels", default="500,1000,2000,5000,10000")
    ap.add_argument("--engine-latency-s", type=float, default=0.5)
    ap.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--cpu-hog", type=int, default=0, metavar="N",
                    help="busy-looping processes beside the server for the whole run (a busy host)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tok = str(cached_tokenizer_dir("qwen3"))
    levels = [int(x) for x in args.levels.split(",")]
    results = []
    with cpu_hogs(args.cpu_hog), \
            sim_engine(args.protocol, tok, extra=["--request-latency-ms", str(args.engine_latency_s * 1000)]) as eng:
        engine_port = int(eng.rsplit(":", 1)[1])
        with server([f"{args.protocol}={eng}"], tok, extra=["--max-sessions", str(max(levels) * 2)]) as url:
            for n in levels:
                r = asyncio.run(_level(url, engine_port, n))
                results.append(r)
                print(f"{n:>6} sessions: errors {r['errors']} {r['errors_by_phase']}  wall {r['wall_s']:.2f}s  "
                      f"{r['turns_per_s']:.0f} turns/s  p50 {r['p50_s']:.2f}s p99 {r['p99_s']:.2f}s  "
                      f"peak engine conns {r['peak_engine_connections']} (engine side {r['peak_engine_accepted_connections']})  "
                      f"tcp {r['tcp_counter_deltas']}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"engine_latency_s": args.engine_latency_s, "cpu_hogs": args.cpu_hog, "levels": results}
    args.json.write_text(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
