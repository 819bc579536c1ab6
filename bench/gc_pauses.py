"""What the cyclic GC has to scan per committed turn, and what a full pass costs then.

CPython's cyclic GC scans every *tracked* container (lists, dicts holding containers,
instances of classes, tuples holding any of those); a session's state stays in the heap
for its whole episode, so each long-lived object a turn leaves behind is scanned again
by every full collection (and by the young passes while it is young). Measured here
in-process, so the count is exact: the server (`running_server`, the options `serve`
runs with) and an aiohttp client on one loop, a simulated engine in its own process; `--sessions`
sessions of `--turns` turns each (history resent every turn, as an agent does), left
open. Before and after, with the client closed and a full collection run:

- `tracked_per_turn`: objects the GC tracks, added per committed turn (all of them:
  the sessions' state and anything else the turns left behind);
- `full_gc_ms`: a full collection (`gc.collect()`, median of three) with those
  sessions live: the pause every automatic full pass costs the event loop;
- `young_gc_ms_max`: the longest young-generation pass (generations 0 and 1) seen
  while the turns ran.

    python bench/gc_pauses.py --sessions 1280 --turns 10 --json bench/results/gc_pauses.json

Against an older commit: `bench/alternate.py --bench-from here --key tracked_per_turn
--key full_gc_ms -- bench/gc_pauses.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import sim_engine  # noqa: E402
from session_server.app import AppConfig  # noqa: E402
from session_server.ops.harness import running_server  # noqa: E402
from session_server.settings import Settings  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


async def _episode(http: aiohttp.ClientSession, url: str, turns: int, max_tokens: int) -> None:
    async with http.post(f"{url}/sessions", json={}) as r:
        r.raise_for_status()
        sid = (await r.json())["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Start the task."}]
    for k in range(turns):
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens}
        async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            reply = (await r.json())["choices"][0]["message"]
        messages = [*messages, {"role": "assistant", "content": reply.get("content") or ""},
                    {"role": "user", "content": f"Go on with step {k + 1}."}]


async def _drive(url: str, sessions: int, turns: int, max_tokens: int, agents: int) -> None:
    left = iter(range(sessions))
    conn = aiohttp.TCPConnector(limit=agents)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def agent() -> None:
            for _ in left:
                await _episode(http, url, turns, max_tokens)

        await asyncio.gather(*(agent() for _ in range(agents)))


def _full_gc_ms() -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    tok = str(cached_tokenizer_dir(args.family))
    young: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started and info["generation"] < 2:
            young.append(1000 * (time.perf_counter() - started.pop()))
        else:
            started.clear()

    with sim_engine("sglang", tok) as engine:
        config = AppConfig(tokenizer=tok, engines=[f"sglang={engine}"],
                           settings=Settings(health_check_interval_s=3600, default_ttl_s=86_400))
        async with running_server(config) as url:
            await _drive(url, args.agents, 2, args.max_tokens, args.agents)  # warm-up sessions
            gc.collect()
            before = len(gc.get_objects())
            gc.callbacks.append(on_gc)
            t0 = time.perf_counter()
            try:
                await _drive(url, args.sessions, args.turns, args.max_tokens, args.agents)
            finally:
                gc.callbacks.remove(on_gc)
            wall = time.perf_counter() - t0
            gc.collect()
            after = len(gc.get_objects())
            full = _full_gc_ms()
    n = args.sessions * args.turns
    return {"family": args.family, "sessions": args.sessions, "turns_per_session": args.turns, "turns": n,
            "tracked_before": before, "tracked_after": after,
            "tracked_per_turn": round((after - before) / n, 3),
            "tracked_per_session": round((after - before) / args.sessions, 2),
            "full_gc_ms": round(full, 1), "young_gc_ms_max": round(max(young, default=0.0), 1),
            "young_gc_passes": len(young), "turns_per_s": round(n / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3", help="a simulator tokenizer family (sim/tokenizers.py)")
    ap.add_argument("--sessions", type=int, default=1280)
    ap.add_argument("--turns", type=int, default=10, help="turns per session")
    ap.add_argument("--agents", type=int, default=64, help="sessions driven at once")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = asyncio.run(measure(args))
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
