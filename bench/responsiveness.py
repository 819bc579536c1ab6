"""Is `/health` still fast while the server moves ~1.3 MiB engine replies?

Workload (after miles PR #1468): a zero-latency simulated engine
whose every reply carries a routed-experts payload (900 rows x 256 floats as
nested JSON lists, or the same as one base64 string); waves of K=64 concurrent
first-turn chats, each on a new connection, for `--seconds`; `/health` polled in
a closed loop with 10 ms sleeps over one keep-alive connection, from its own
process. Server, engine, load generator and poller are separate processes. Writes JSON (`health_ms` p50/p95/p99/max, `chats_per_s`,
`errors`) and a PNG of /health latency over time.

    python bench/responsiveness.py --json bench/results/responsiveness.json

`--stream-fraction 0 0.5` runs the same workload twice (fresh server and engine each):
all chats non-streamed, then half of each wave sent with `stream: true` and read frame
by frame as SSE, as an agent would (/health must still hold while chats stream).

    python bench/responsiveness.py --payload floats --stream-fraction 0 0.5 \
        --json bench/results/responsiveness_streaming.json

`--stall-probe` measures a different workload (loop stalls that grow with
context or session count): `--idle-sessions` (100K) idle sessions exist while the
TTL sweeper runs every 5 s, and one session holds a `--context-tokens` (~100K)
context. Three phases of `--seconds` each, /health polled as above throughout:
`idle` (nothing but the sweeps), `export` (that session's JSON trajectory fetched
in a closed loop) and `cache_aware` (chats on that session, so each turn hashes
the 100K-token prefix; the server runs `--routing-policy cache_aware`). Writes
p50/p99/max and the count of samples over 20 ms per phase.

    python bench/responsiveness.py --stall-probe --json bench/results/stall_probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import server, sim_engine  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Run the task."}], "max_tokens": 16}


def _poll_health_process(url: str, ready: Any, stop: Any, out: Any) -> None:
    """Poll /health in a closed loop (10 ms sleeps, one keep-alive connection) in its
    own process, so client-side load never shows up as server latency. The request
    that opens the connection is not a sample (it measures TCP set-up); `ready` is
    set once the connection is up, and the load starts only then."""
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # the measurement itself runs at normal priority

    async def poll() -> list[tuple[float, float]]:
        samples: list[tuple[float, float]] = []
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as r:
                await r.read()
            ready.set()
            t_start = time.perf_counter()
            while not stop.is_set():
                t0 = time.perf_counter()
                async with http.get(f"{url}/health") as r:
                    await r.read()
                samples.append((t0 - t_start, (time.perf_counter() - t0) * 1000))
                await asyncio.sleep(0.01)
        return samples

    out.send(asyncio.run(poll()))


async def start_health_poller(url: str) -> tuple[Any, Any, Any]:
    """`_poll_health_process` started and connected: (process, stop event, receiving
    end of the pipe its samples come back on)."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    poller = ctx.Process(target=_poll_health_process, args=(url, ready, stop, send), daemon=True)
    poller.start()
    if not await asyncio.to_thread(ready.wait, 60):
        raise RuntimeError("the /health poller did not start")
    return poller, stop, recv


async def _read_sse(r: aiohttp.ClientResponse) -> int:
    """Every frame of a streamed answer, as an agent reads it; the count of `data:`
    frames, or -1 when the stream ended without `[DONE]` (cut or failed)."""
    frames, done = 0, False
    async for line in r.content:
        if line.startswith(b"data:"):
            frames += 1
            done = line.strip() == b"data: [DONE]"
    return frames if done else -1


async def _one_chat(url: str, errors: dict[str, int], stream: bool = False,
                    frames: list[int] | None = None) -> bool:
    """One first-turn chat on a new session and connection; `stream` sends it with
    `stream: true` and reads it as SSE (its frame count goes to `frames`)."""
    conn = aiohttp.TCPConnector(force_close=True)
    body = {**CHAT, "stream": True} if stream else CHAT
    async with aiohttp.ClientSession(connector=conn) as http:
        try:
            async with http.post(f"{url}/sessions", json={}) as r:
                sid = (await r.json())["session_id"]
            async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    await r.read()
                    errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                    return False
                if not stream:
                    await r.read()
                    return True
                n = await _read_sse(r)
                if n < 0:
                    errors["stream_without_done"] = errors.get("stream_without_done", 0) + 1
                    return False
                if frames is not None:
                    frames.append(n)
            return True
        except aiohttp.ClientError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return False


async def _measure(url: str, k: int, seconds: float, nice: int, stream_fraction: float = 0.0) -> dict[str, Any]:
    """Waves of `k` chats for `seconds`; `round(k * stream_fraction)` of each wave stream."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    poller = ctx.Process(target=_poll_health_process, args=(url, ready, stop, send), daemon=True)
    poller.start()
    os.setpriority(os.PRIO_PROCESS, 0, nice)  # the load generator stands in for other machines
    errors: dict[str, int] = {}
    if not await asyncio.to_thread(ready.wait, 60):
        raise RuntimeError("the /health poller did not start")
    await asyncio.sleep(0.3)  # a baseline before the load
    t0 = time.perf_counter()
    ok, n_stream, frames = 0, round(k * stream_fraction), []
    while time.perf_counter() - t0 < seconds:
        results = await asyncio.gather(*(_one_chat(url, errors, i < n_stream, frames) for i in range(k)))
        ok += sum(results)
    elapsed = time.perf_counter() - t0
    stop.set()
    samples: list[tuple[float, float]] = await asyncio.to_thread(recv.recv)
    poller.join(timeout=10)
    lat = np.array([ms for _, ms in samples])
    return {
        "health_ms": {
            "p50": float(np.percentile(lat, 50)),
            "p95": float(np.percentile(lat, 95)),
            "p99": float(np.percentile(lat, 99)),
            "max": float(lat.max()),
            "samples": int(lat.size),
        },
        "chats_per_s": ok / elapsed,
        "chats": ok,
        "stream_fraction": stream_fraction,
        "streamed_chats": len(frames),
        "sse_frames_per_streamed_chat": float(np.mean(frames)) if frames else 0.0,
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "series": samples,
    }


async def _create_sessions(url: str, n: int, concurrency: int = 32) -> float:
    """`n` idle sessions over `concurrency` keep-alive connections; returns seconds taken."""
    t0 = time.perf_counter()
    left = n

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with http.post(f"{url}/sessions", json={}) as r:
                if r.status != 201:
                    raise RuntimeError(f"POST /sessions -> {r.status}: {await r.text()}")
                await r.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return time.perf_counter() - t0


async def _big_session(http: aiohttp.ClientSession, url: str, tokens: int) -> tuple[str, int]:
    """A session whose first turn carries a ~`tokens`-token user message."""
    async with http.post(f"{url}/sessions", json={}) as r:
        sid = (await r.json())["session_id"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cached_tokenizer_dir("qwen3")))
    per_word = len(tok(" hello" * 1000)["input_ids"]) / 1000  # the sim's toy vocabulary splits words
    body = {**CHAT, "messages": [{"role": "user", "content": " hello" * int(tokens / per_word)}]}
    async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"big first turn -> {r.status}: {await r.text()}")
        usage = (await r.json())["usage"]
    return sid, int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


async def _phase_load(url: str, sid: str, phase: str, seconds: float) -> int:
    """Closed-loop load of one phase on the big session; returns requests done."""
    done = 0
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() - t0 < seconds:
            if phase == "idle":
                await asyncio.sleep(0.1)
                continue
            if phase == "export":
                async with http.get(f"{url}/sessions/{sid}/trajectory") as r:
                    await r.read()
                    ok = r.status == 200
            else:
                chat = {**CHAT, "messages": [{"role": "user", "content": f"Next step {done}."}], "max_tokens": 8}
                async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=chat) as r:
                    await r.read()
                    ok = r.status == 200
            if not ok:
                raise RuntimeError(f"{phase} request failed: {r.status}")
            done += 1
    return done


def _summary(lat_ms: list[float]) -> dict[str, float | int]:
    lat = np.array(lat_ms)
    return {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
            "max": float(lat.max()), "over_20ms": int((lat > 20).sum()), "samples": int(lat.size)}


async def _stall_probe(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        sid, context = await _big_session(http, url, args.context_tokens)
    made_s = await _create_sessions(url, args.idle_sessions)
    print(f"made {args.idle_sessions} sessions in {made_s:.1f} s; big session at {context} tokens", flush=True)
    poller, stop, recv = await start_health_poller(url)
    bounds: dict[str, tuple[float, float, int]] = {}
    t_start = time.perf_counter()  # the poller's clock starts within a few ms of this
    for phase in ("idle", "export", "cache_aware"):
        a = time.perf_counter() - t_start
        n = await _phase_load(url, sid, phase, args.seconds)
        bounds[phase] = (a, time.perf_counter() - t_start, n)
    stop.set()
    samples: list[tuple[float, float]] = await asyncio.to_thread(recv.recv)
    poller.join(timeout=10)
    phases = {}
    for phase, (a, b, n) in bounds.items():
        lat = [ms for t, ms in samples if a <= t < b]
        phases[phase] = {"health_ms": _summary(lat), "requests": n, "requests_per_s": n / (b - a)}
    return {"idle_sessions": args.idle_sessions, "context_tokens": context, "sessions_made_s": made_s,
            "phases": phases}


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, r in results.items():
        xs, ys = zip(*r["series"], strict=True) if r["series"] else ((), ())
        ax.plot(xs, ys, ".", ms=3, label=f"{name}: p99 {r['health_ms']['p99']:.1f} ms, {r['chats_per_s']:.1f} chats/s")
    ax.axhline(50, color="red", lw=0.8, ls="--", label="target p99 50 ms")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("/health latency (ms)")
    ax.set_title("/health while 64 concurrent chats receive ~1.3 MiB engine replies")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--payload", choices=("floats", "base64", "none", "both"), default="both",
                    help="'none' is a diagnostic baseline: the same chats with small replies")
    ap.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--server-args", default="", help="extra `session-server serve` arguments")
    ap.add_argument("--nice", type=int, default=10,
                    help="CPU niceness of the load generator and the simulated engine, which stand in "
                         "for other machines; the server and the /health poller run at 0 (use 0 for all)")
    ap.add_argument("--stream-fraction", type=float, nargs="+", default=[0.0],
                    help="the share of each wave's chats sent with `stream: true` and read as SSE; "
                         "several values run one after another, each on a fresh server and engine")
    ap.add_argument("--stall-probe", action="store_true",
                    help="the issue-8 stall probe instead (idle sessions, big export, cache_aware hashing)")
    ap.add_argument("--idle-sessions", type=int, default=100_000)
    ap.add_argument("--context-tokens", type=int, default=100_000)
    args = ap.parse_args()
    tok = str(cached_tokenizer_dir("qwen3"))
    if args.stall_probe:
        return _run_stall_probe(args, tok)
    variants = ("floats", "base64") if args.payload == "both" else (args.payload,)
    load_before = os.getloadavg()  # the machine may be shared: note what else was running
    results: dict[str, dict[str, Any]] = {}
    for payload, fraction in ((p, f) for p in variants for f in args.stream_fraction):
        name = payload if fraction == 0 else f"{payload}_stream{round(fraction * 100)}"
        padding = [] if payload == "none" else ["--padding", payload]
        with sim_engine(args.protocol, tok, extra=padding, nice=args.nice) as eng, server(
            [f"{args.protocol}={eng}"], tok, extra=args.server_args.split()
        ) as url:
            results[name] = asyncio.run(_measure(url, args.k, args.seconds, args.nice, fraction))
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        r = results[name]
        print(f"{name:>16}: /health p50 {r['health_ms']['p50']:.1f} p95 {r['health_ms']['p95']:.1f} "
              f"p99 {r['health_ms']['p99']:.1f} max {r['health_ms']['max']:.1f} ms; "
              f"{r['chats_per_s']:.1f} chats/s; errors {r['errors']}")
    png = args.png or args.json.with_suffix(".png")
    _plot(results, png)
    first = next(iter(results.values()))
    out = {
        "workload": {"k": args.k, "seconds": args.seconds, "protocol": args.protocol, "payload": variants[0],
                     "nice_load_and_engine": args.nice, "server_args": args.server_args,
                     "stream_fractions": args.stream_fraction, "loadavg_before": load_before,
                     "loadavg_after": os.getloadavg()},
        "health_ms": first["health_ms"],
        "chats_per_s": first["chats_per_s"],
        "errors": sum(r["errors"] for r in results.values()),
        "variants": {name: {k: v for k, v in r.items() if k != "series"} for name, r in results.items()},
        "png": str(png),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


def _run_stall_probe(args: argparse.Namespace, tok: str) -> int:
    extra = ["--routing-policy", "cache_aware", "--max-sessions", str(args.idle_sessions + 10),
             *args.server_args.split()]
    with sim_engine(args.protocol, tok, nice=args.nice) as eng, server([f"{args.protocol}={eng}"], tok,
                                                                       extra=extra) as url:
        out = asyncio.run(_stall_probe(url, args))
    out["workload"] = {"seconds_per_phase": args.seconds, "protocol": args.protocol, "server_args": extra}
    for phase, r in out["phases"].items():
        h = r["health_ms"]
        print(f"{phase:>11}: /health p50 {h['p50']:.1f} p99 {h['p99']:.1f} max {h['max']:.1f} ms, "
              f"{h['over_20ms']} of {h['samples']} over 20 ms; {r['requests_per_s']:.1f} req/s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
