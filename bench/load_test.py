"""Concurrency sweep: one turn per session at 500 ... 10,000 concurrent sessions.

Server and simulated engine run as separate processes; the engine answers every
request after `--engine-latency-s` (0.5 s). Per level: errors by kind, wall time,
turns/s, p50/p99 turn latency, and the peak number of open TCP connections from
the server to the engine (sampled from /proc/net/tcp), which must stay bounded
by the per-engine cap however many agents connect.

    python bench/load_test.py --json bench/results/load_test.json [--levels 500,1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
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


async def _level(url: str, engine_port: int, n: int) -> dict[str, Any]:
    errors: dict[str, int] = {}
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        sem = asyncio.Semaphore(512)

        async def create() -> str:
            async with sem, http.post(f"{url}/sessions", json={}) as r:
                return str((await r.json())["session_id"])

        sids = await asyncio.gather(*(create() for _ in range(n)))
        latencies: list[float] = []

        async def chat(sid: str) -> None:
            t0 = time.perf_counter()
            try:
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=CHAT) as r:
                    await r.read()
                    if r.status != 200:
                        errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                        return
            except (TimeoutError, aiohttp.ClientError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
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
            async with sem, http.delete(f"{url}/sessions/{sid}") as r:
                await r.read()

        await asyncio.gather(*(delete(s) for s in sids))
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    return {
        "concurrency": n,
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
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
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tok = str(cached_tokenizer_dir("qwen3"))
    levels = [int(x) for x in args.levels.split(",")]
    results = []
    with sim_engine(args.protocol, tok, extra=["--request-latency-ms", str(args.engine_latency_s * 1000)]) as eng:
        engine_port = int(eng.rsplit(":", 1)[1])
        with server([f"{args.protocol}={eng}"], tok, extra=["--max-sessions", str(max(levels) * 2)]) as url:
            for n in levels:
                r = asyncio.run(_level(url, engine_port, n))
                results.append(r)
                print(f"{n:>6} sessions: errors {r['errors']} {r['errors_by_kind']}  wall {r['wall_s']:.2f}s  "
                      f"{r['turns_per_s']:.0f} turns/s  p50 {r['p50_s']:.2f}s p99 {r['p99_s']:.2f}s  "
                      f"peak engine conns {r['peak_engine_connections']} (engine side {r['peak_engine_accepted_connections']})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"engine_latency_s": args.engine_latency_s, "levels": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
