"""Is `/health` still fast while the server moves ~1.3 MiB engine replies?

Workload (DESIGN.md s11, after miles PR #1468): a zero-latency simulated engine
whose every reply carries a routed-experts payload (900 rows x 256 floats as
nested JSON lists, or the same as one base64 string); waves of K=64 concurrent
first-turn chats, each on a new connection, for `--seconds`; `/health` polled in
a closed loop with 10 ms sleeps over one keep-alive connection. Server and engine
are separate processes. Writes JSON (`health_ms` p50/p95/p99/max, `chats_per_s`,
`errors`) and a PNG of /health latency over time.

    python bench/responsiveness.py --json bench/results/responsiveness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def _poll_health(url: str, stop: asyncio.Event, samples: list[tuple[float, float]]) -> None:
    async with aiohttp.ClientSession() as http:
        t_start = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            async with http.get(f"{url}/health") as r:
                await r.read()
            samples.append((t0 - t_start, (time.perf_counter() - t0) * 1000))
            await asyncio.sleep(0.01)


async def _one_chat(url: str, errors: dict[str, int]) -> bool:
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        try:
            async with http.post(f"{url}/sessions", json={}) as r:
                sid = (await r.json())["session_id"]
            async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=CHAT) as r:
                await r.read()
                if r.status != 200:
                    errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                    return False
            async with http.delete(f"{url}/sessions/{sid}") as r:
                await r.read()
            return True
        except aiohttp.ClientError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return False


async def _measure(url: str, k: int, seconds: float) -> dict[str, Any]:
    stop = asyncio.Event()
    samples: list[tuple[float, float]] = []
    errors: dict[str, int] = {}
    poller = asyncio.create_task(_poll_health(url, stop, samples))
    await asyncio.sleep(0.3)  # baseline before the load
    t0 = time.perf_counter()
    ok = 0
    while time.perf_counter() - t0 < seconds:
        results = await asyncio.gather(*(_one_chat(url, errors) for _ in range(k)))
        ok += sum(results)
    elapsed = time.perf_counter() - t0
    stop.set()
    await poller
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
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "series": samples,
    }


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
    ap.add_argument("--payload", choices=("floats", "base64", "both"), default="both")
    ap.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang")
    args = ap.parse_args()
    tok = str(cached_tokenizer_dir("qwen3"))
    variants = ("floats", "base64") if args.payload == "both" else (args.payload,)
    results: dict[str, dict[str, Any]] = {}
    for payload in variants:
        with sim_engine(args.protocol, tok, extra=["--padding", payload]) as eng, server(
            [f"{args.protocol}={eng}"], tok
        ) as url:
            results[payload] = asyncio.run(_measure(url, args.k, args.seconds))
        r = results[payload]
        print(f"{payload:>7}: /health p50 {r['health_ms']['p50']:.1f} p95 {r['health_ms']['p95']:.1f} "
              f"p99 {r['health_ms']['p99']:.1f} max {r['health_ms']['max']:.1f} ms; "
              f"{r['chats_per_s']:.1f} chats/s; errors {r['errors']}")
    png = args.png or args.json.with_suffix(".png")
    _plot(results, png)
    first = results[variants[0]]
    out = {
        "workload": {"k": args.k, "seconds": args.seconds, "protocol": args.protocol, "payload": variants[0]},
        "health_ms": first["health_ms"],
        "chats_per_s": first["chats_per_s"],
        "errors": sum(r["errors"] for r in results.values()),
        "variants": {name: {k: v for k, v in r.items() if k != "series"} for name, r in results.items()},
        "png": str(png),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
