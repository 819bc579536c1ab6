"""Scale-out: small turns/s and p99 for 1, 2 and 4 `serve` processes.

Each configuration serves the same closed loop of `--agents` concurrent agents for
`--duration-s` seconds: an agent creates a session, plays `--turns` small turns
(8 sampled tokens, history growing by one exchange per turn), deletes it and
starts over. One simulated engine process (no sampling latency) stands in for the
engine pool, so what is measured is the session layer. Configurations:

- `direct-1`: one `serve` process, no proxy (the per-process ceiling);
- `cluster-N`: `session-server cluster --workers N` (HAProxy in front), N = 1, 2, 4.

Per configuration: turns/s, p50/p99 turn latency, errors, and the CPU seconds
each part used (workers, HAProxy, engine, this load generator) from /proc, which
says what bounds the scaling on this machine.

    python bench/scale_out.py --json bench/results/scale_out.json [--workers 1,2,4] [--duration-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import TICKS, process, server, sim_engine  # noqa: E402
from bench._procs import children as _children  # noqa: E402
from bench._procs import process_cpu_s as _cpu_s  # noqa: E402
from session_server.ops.harness import free_port  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all processes, ours and others'), /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]  # guest is in user
    return (sum(f) - f[3] - f[4]) / TICKS  # minus idle and iowait



def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _pid_listening(port: int) -> int | None:
    """The pid whose socket listens on 127.0.0.1:port (our own processes only)."""
    hexport = f"{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[1].endswith(":" + hexport) and parts[3] == "0A":
                    inodes.add(parts[9])
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(proc.name)
    return None


def _descendants(pid: int) -> list[int]:
    out, stack = [], _children(pid)
    while stack:
        p = stack.pop()
        out.append(p)
        stack += _children(p)
    return out


def _groups(root: int, engine_pid: int | None) -> tuple[dict[str, list[int]], int]:
    """The processes of a configuration by role, and how many `serve` processes it has.
    A cluster's root is the `cluster` supervisor (its children: HAProxy and the workers,
    with their decode processes); a direct server's root is the server itself."""
    kids = _children(root)
    haproxy = [k for k in kids if _comm(k) == "haproxy"]
    engine = [engine_pid] if engine_pid else []
    if not haproxy:
        return {"workers": [root, *_descendants(root)], "haproxy": [], "engine": engine}, 1
    workers = [k for k in kids if k not in haproxy]
    tree = [p for w in workers for p in (w, *_descendants(w))]
    return {"workers": tree, "haproxy": haproxy, "supervisor": [root], "engine": engine}, len(workers)


async def _agent(http: aiohttp.ClientSession, url: str, turns: int, stop: float,
                 lat: list[float], errors: dict[str, int]) -> None:
    while time.monotonic() < stop:
        try:
            async with http.post(f"{url}/sessions", json={}) as r:
                if r.status != 201:
                    errors[f"create {r.status}"] = errors.get(f"create {r.status}", 0) + 1
                    continue
                sid = (await r.json())["session_id"]
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Run the task."}]
            for t in range(turns):
                if time.monotonic() >= stop:
                    break
                t0 = time.perf_counter()
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions",
                                     json={"model": "m", "messages": messages, "max_tokens": 8}) as r:
                    body = await r.json(content_type=None)
                    if r.status != 200:
                        errors[f"chat {r.status}"] = errors.get(f"chat {r.status}", 0) + 1
                        break
                lat.append(time.perf_counter() - t0)
                messages += [body["choices"][0]["message"], {"role": "user", "content": f"step {t}"}]
            async with http.delete(f"{url}/sessions/{sid}") as r:
                await r.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1


async def _drive(url: str, agents: int, turns: int, duration_s: float, warmup_s: float) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as http:
        warm: list[float] = []
        await asyncio.gather(*(_agent(http, url, turns, time.monotonic() + warmup_s, warm, {})
                               for _ in range(agents)))
        lat: list[float] = []
        errors: dict[str, int] = {}
        t0 = time.monotonic()
        await asyncio.gather(*(_agent(http, url, turns, t0 + duration_s, lat, errors) for _ in range(agents)))
        wall = time.monotonic() - t0
    arr = np.asarray(lat) * 1000
    return {"turns": len(lat), "wall_s": round(wall, 2), "turns_per_s": round(len(lat) / wall, 1),
            "p50_ms": round(float(np.percentile(arr, 50)), 1) if len(arr) else None,
            "p99_ms": round(float(np.percentile(arr, 99)), 1) if len(arr) else None, "errors": errors}


@contextlib.contextmanager
def _cluster(engine: str, tokenizer: str, workers: int) -> Iterator[str]:
    port = free_port()
    args = ["cluster", "--workers", str(workers), "--port", str(port), "--engine", f"sglang={engine}",
            "--tokenizer", tokenizer, "--log-level", "warning", "--cpu-workers", "1",
            "--no-journal"]  # the single `serve` it is compared with keeps no journal either (journal.py measures that)
    with process(args, f"http://127.0.0.1:{port}") as url:
        yield url


def _server_root(url: str) -> int:
    pid = _pid_listening(int(url.rsplit(":", 1)[1]))
    if pid is None:
        raise RuntimeError(f"no process listens for {url}")
    while _comm(pid) == "haproxy":  # the cluster: HAProxy's parent is the `cluster` process
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return pid


def _measure(name: str, url: str, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    root = _server_root(url)
    roles, n_serve = _groups(root, _pid_listening(int(engine.rsplit(":", 1)[1])))
    before = {r: sum(_cpu_s(p) for p in ps) for r, ps in roles.items()}
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    machine0 = _machine_busy_s()
    out = asyncio.run(_drive(url, args.agents, args.turns, args.duration_s, args.warmup_s))
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    machine = _machine_busy_s() - machine0
    cpu = {r: round(sum(_cpu_s(p) for p in ps) - before[r], 2) for r, ps in roles.items()}
    cpu["load_generator"] = round((me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime), 2)
    cpu["other_tenants"] = round(max(0.0, machine - sum(cpu.values())), 2)  # other work on this machine
    out.update(config=name, processes=n_serve, cpu_s=cpu,
               cores_busy_ours=round((machine - cpu["other_tenants"]) / out["wall_s"], 2),
               cores_busy_machine=round(machine / out["wall_s"], 2),
               worker_cpu_ms_per_turn=round(1000 * cpu["workers"] / max(1, out["turns"]), 2))
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--workers", default="1,2,4", help="cluster sizes to measure")
    ap.add_argument("--agents", type=int, default=64, help="concurrent agents (closed loop)")
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    args = ap.parse_args()
    if shutil.which("haproxy") is None:
        print("haproxy is not installed (apt-get install haproxy)", file=sys.stderr)
        return 2
    tok = str(cached_tokenizer_dir("qwen3"))
    results: list[dict[str, Any]] = []
    loadavg_before = os.getloadavg()
    with sim_engine("sglang", tok) as engine:
        with server([f"sglang={engine}"], tok, extra=["--cpu-workers", "1"]) as url:
            results.append(_measure("direct-1", url, engine, args))
        for n in (int(x) for x in args.workers.split(",")):
            with _cluster(engine, tok, n) as url:
                results.append(_measure(f"cluster-{n}", url, engine, args))
    base = results[0]["turns_per_s"]
    for r in results:
        r["scaling_vs_direct_1"] = round(r["turns_per_s"] / base, 2) if base else None
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_before": loadavg_before},
              "params": {"agents": args.agents, "turns_per_session": args.turns, "max_tokens": 8,
                         "duration_s": args.duration_s, "engine": "one sim-engine process, no latency"},
              "results": results}
    report["machine"]["loadavg_after"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
