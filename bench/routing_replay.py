"""Routing replay (R3): what recording routed experts costs one server process.

Workload: a zero-latency simulated SGLang engine of a 60-layer, top-8 MoE (128
experts), `--sessions` concurrent sessions each running `--turns` turns whose
answers are ~`--tokens` sampled tokens (a scripted long answer, `max_tokens`
= tokens), through ONE `session-server` process, with `routing_replay` on and
then off (fresh server and engine each). `/health` is polled in a closed loop
(10 ms sleeps) from its own process throughout, and the server's own event loop
is watched from inside (bench/_loopwatch.py: its lag, and the time lost in stalls
split into the loop's own work, waiting for a CPU, and waiting for the GIL). The
on/off legs alternate `--repeat` times (the machine is shared: each leg records
the load average it started at); the medians are reported. Then:

* bytes stored per token: the routed-experts arrays the server keeps (the sample
  export's `routed_experts`, uint8 `(len(tokens) - 1, 60, 8)`), nbytes / positions
  and nbytes / sampled tokens (target <= 500 B per token);
* peak RSS of the server (VmHWM) after `--rss-sessions` sessions of one short
  turn each (`--rss-tokens` sampled tokens), R3 on and off.

    python bench/routing_replay.py --json bench/results/routing_replay.json
    python bench/routing_replay.py --quick --json /tmp/r3.json   (seconds; for the test)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._loopwatch import summary as loop_summary  # noqa: E402
from bench._procs import PIDS, server, sim_engine  # noqa: E402
from bench.responsiveness import start_health_poller  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

LAYERS, TOPK, EXPERTS = 60, 8, 128
WORDS = "read the config file then run the failing test and fix the import error".split()


def _answer(tokens: int) -> str:
    """A scripted answer of about `tokens` tokens (the qwen3 sim tokenizer: ~1 per word)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens))


async def _session(http: aiohttp.ClientSession, url: str, r3: bool, turns: int, tokens: int,
                   stats: dict[str, Any]) -> None:
    async with http.post(f"{url}/sessions", json={"routing_replay": r3}) as r:
        sid = (await r.json())["session_id"]
    stats["sids"].append(sid)
    history: list[dict[str, Any]] = []
    for t in range(turns):
        history.append({"role": "user", "content": f"Step {t}: go on."})
        body = {"model": "m", "messages": history, "max_tokens": tokens}
        async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
            data = await r.json(content_type=None)
        if r.status != 200:
            stats["errors"][str(r.status)] = stats["errors"].get(str(r.status), 0) + 1
            return
        stats["turns"] += 1
        stats["sampled"] += data["usage"]["completion_tokens"]
        history.append(data["choices"][0]["message"])


def _rss_mib(pid: int) -> dict[str, float]:
    """Current and peak resident set of a process (/proc), MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[v].split()[0]) / 1024 for k, v in (("rss_mib", "VmRSS"), ("peak_rss_mib", "VmHWM"))}


async def _stored_bytes(http: aiohttp.ClientSession, url: str, sids: list[str]) -> dict[str, Any]:
    """What the server stores for routed experts, from the sample export (npz)."""
    nbytes = positions = sampled = 0
    dtype = None
    for sid in sids:
        async with http.get(f"{url}/sessions/{sid}/samples", params={"format": "npz"}) as r:
            raw = await r.read()
        arrays = np.load(io.BytesIO(raw))
        if "routed_experts" not in arrays:
            continue
        rows = arrays["routed_experts"]
        dtype = str(rows.dtype)
        nbytes += int(rows.nbytes)
        positions += int(rows.shape[0])
        sampled += int(arrays["loss_mask"].sum())
    return {"dtype": dtype, "routed_bytes": nbytes, "positions": positions, "sampled_tokens": sampled,
            "bytes_per_position": nbytes / positions if positions else None,
            "bytes_per_sampled_token": nbytes / sampled if sampled else None,
            "target_bytes_per_token": 500,
            "meets_target": bool(positions and nbytes / positions <= 500)}


async def _throughput(url: str, r3: bool, sessions: int, turns: int, tokens: int,
                      watch: Path | None = None) -> dict[str, Any]:
    poller, stop, recv = await start_health_poller(url)
    stats: dict[str, Any] = {"turns": 0, "sampled": 0, "errors": {}, "sids": []}
    timeout = aiohttp.ClientTimeout(total=600)
    load = os.getloadavg()[0]
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0, wall0 = time.perf_counter(), time.time()
        await asyncio.gather(*(_session(http, url, r3, turns, tokens, stats) for _ in range(sessions)))
        elapsed, wall1 = time.perf_counter() - t0, time.time()
        stop.set()
        samples: list[tuple[float, float]] = await asyncio.to_thread(recv.recv)
        poller.join(timeout=10)
        stored = await _stored_bytes(http, url, stats["sids"]) if r3 else None
    lat = np.array([ms for _, ms in samples]) if samples else np.zeros(1)
    out = {
        "routing_replay": r3, "sessions": sessions, "turns": stats["turns"], "errors": stats["errors"],
        "sampled_tokens": stats["sampled"], "sampled_tokens_per_turn": stats["sampled"] / max(1, stats["turns"]),
        "wall_s": round(elapsed, 3), "turns_per_s": stats["turns"] / elapsed,
        "sampled_tokens_per_s": stats["sampled"] / elapsed,
        "health_ms": {"n": int(len(samples)), "p50": float(np.percentile(lat, 50)),
                      "p99": float(np.percentile(lat, 99)), "max": float(lat.max())},
        "load_avg_1m": load,
    }
    if watch is not None:
        await asyncio.sleep(0.4)  # the watch flushes every 0.25 s
        out["server_loop_lag_ms"] = loop_summary(watch, wall0, wall1)
    if stored is not None:
        out["stored"] = stored
    return out


async def _rss(url: str, pid: int, r3: bool, sessions: int, tokens: int, concurrency: int = 32) -> dict[str, Any]:
    stats: dict[str, Any] = {"turns": 0, "sampled": 0, "errors": {}, "sids": []}
    before = _rss_mib(pid)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def one() -> None:
            async with sem:
                await _session(http, url, r3, 1, tokens, stats)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(sessions)))
        elapsed = time.perf_counter() - t0
    after = _rss_mib(pid)
    return {"routing_replay": r3, "sessions": sessions, "turns": stats["turns"], "errors": stats["errors"],
            "sampled_tokens": stats["sampled"], "wall_s": round(elapsed, 3),
            "rss_mib_at_start": before["rss_mib"], **after}


SERVE_ARGS = ["--routed-experts-topk", str(TOPK), "--routed-experts-layers", str(LAYERS),
              "--routed-experts-num-experts", str(EXPERTS)]


async def _script(engine: str, tokens: int) -> None:
    async with aiohttp.ClientSession() as http, http.post(
        f"{engine}/sim/script", json={"turns": [{"content": _answer(tokens)}]}
    ) as r:
        assert r.status == 200, await r.text()


WATCHED = [sys.executable, str(Path(__file__).resolve().parent / "_loopwatch.py")]


def _phase(tokenizer: str, fn: Any, tokens: int, watch: Path | None = None) -> Any:
    """A fresh engine and server for one measurement; `fn(url, pid)` runs it. With
    `watch`, the server's loop lag is written there (bench/_loopwatch.py)."""
    sim_args = ["--routed-layers", str(LAYERS), "--routed-topk", str(TOPK), "--routed-experts", str(EXPERTS)]
    if watch is not None:
        os.environ["LOOPWATCH_FILE"] = str(watch)
    try:
        with sim_engine("sglang", tokenizer, extra=sim_args) as engine, \
                server([f"sglang={engine}"], tokenizer, extra=SERVE_ARGS, cli=WATCHED) as url:
            asyncio.run(_script(engine, tokens))
            return asyncio.run(fn(url, PIDS[url]))
    finally:
        os.environ.pop("LOOPWATCH_FILE", None)


def _leg_summary(leg: dict[str, Any]) -> dict[str, Any]:
    lag = leg.get("server_loop_lag_ms", {})
    return {"routing_replay": leg["routing_replay"], "turns_per_s": leg["turns_per_s"],
            "health_p99_ms": leg["health_ms"]["p99"], "loop_lag_p99_ms": lag.get("p99"),
            "stalled_ms": lag.get("stalled_ms"), "stalled_blocked_ms": lag.get("stalled_blocked_ms"),
            "load_avg_1m": leg["load_avg_1m"]}


def _medians(legs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over the legs (None where a leg lacks it)."""
    keys = ("turns_per_s", "health_p99_ms", "loop_lag_p99_ms", "stalled_ms", "stalled_blocked_ms", "load_avg_1m")
    return {k: statistics.median(v) if (v := [leg[k] for leg in legs if leg[k] is not None]) else None
            for k in keys}


def _alternating(tokenizer: str, a: argparse.Namespace, watch_dir: Path) -> dict[str, Any]:
    """R3 on and off legs, alternating `a.repeat` times: the legs of median turns/s (in
    full), every leg's summary and the medians."""
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    order: list[dict[str, Any]] = []
    for i in range(a.repeat):
        for r3 in (True, False):
            watch = watch_dir / f"lag_{i}_{int(r3)}.txt"
            leg = _phase(tokenizer, lambda url, pid, r3=r3, watch=watch: _throughput(
                url, r3, a.sessions, a.turns, a.tokens, watch), a.tokens, watch)
            runs[r3].append(leg)
            order.append(_leg_summary(leg))
    out: dict[str, Any] = {}
    for r3, key in ((True, "r3_on"), (False, "r3_off")):
        legs = sorted(runs[r3], key=lambda leg: leg["turns_per_s"])
        out[key] = legs[len(legs) // 2]
    out["legs"] = order
    med = {key: _medians([leg for leg in order if leg["routing_replay"] is r3])
           for r3, key in ((True, "r3_on"), (False, "r3_off"))}
    on, off = med["r3_on"], med["r3_off"]
    med["turns_per_s_ratio_on_off"] = on["turns_per_s"] / off["turns_per_s"] if off["turns_per_s"] else None
    med["health_p99_ratio_on_off"] = on["health_p99_ms"] / off["health_p99_ms"] if off["health_p99_ms"] else None
    out["median"] = med
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small run (seconds), for the test")
    p.add_argument("--sessions", type=int, default=8, help="concurrent sessions in the throughput phase")
    p.add_argument("--turns", type=int, default=3, help="turns per session in the throughput phase")
    p.add_argument("--tokens", type=int, default=4096, help="sampled tokens per turn (max_tokens)")
    p.add_argument("--rss-sessions", type=int, default=1000, help="sessions in the peak-RSS phase")
    p.add_argument("--rss-tokens", type=int, default=256, help="sampled tokens of each RSS-phase turn")
    p.add_argument("--repeat", type=int, default=3, help="alternating R3 on/off throughput legs of each")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    a = p.parse_args()
    if a.quick:
        a.sessions, a.turns, a.tokens, a.rss_sessions, a.rss_tokens, a.repeat = 2, 2, 256, 20, 64, 1
    tokenizer = str(cached_tokenizer_dir("qwen3"))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"quick": a.quick, "model": {"layers": LAYERS, "topk": TOPK, "experts": EXPERTS},
                           "engine": "sglang (simulated, zero latency)", "server_processes": 1}
    with tempfile.TemporaryDirectory(prefix="r3-loopwatch-") as watch_dir:
        out.update(_alternating(tokenizer, a, Path(watch_dir)))
    out["turns_per_s_ratio_on_off"] = out["median"]["turns_per_s_ratio_on_off"]
    out["rss"] = {("r3_on" if r3 else "r3_off"): _phase(
        tokenizer, lambda url, pid, r3=r3: _rss(url, pid, r3, a.rss_sessions, a.rss_tokens), a.rss_tokens)
        for r3 in (True, False)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
