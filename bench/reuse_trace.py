"""Evidence: when does a busy client send on a pooled connection, and what happens.

The create phase of `load_test.py` (10,000 sessions through 512 concurrent
requests) leaves 512 idle keep-alive connections in the aiohttp pool; the chat
phase then starts 10,000 requests at once. This traces, with aiohttp's
TraceConfig, which chat requests reused a pooled connection, when their request
actually went out (first body chunk; aiohttp sends the buffered headers with it)
measured from the end of the create phase, and how each request ended.

    python bench/reuse_trace.py --json bench/results/reuse_trace.json [--sessions 10000] [--cpu-hog 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import server, sim_engine  # noqa: E402
from bench.load_test import CHAT, cpu_hogs  # noqa: E402
from session_server.ops.serving import KEEP_ALIVE_S  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


def _spread(xs: list[float]) -> dict[str, float] | None:
    """min / median / max, rounded to 10 ms."""
    if not xs:
        return None
    xs = sorted(xs)
    return {"min": round(xs[0], 2), "median": round(xs[len(xs) // 2], 2), "max": round(xs[-1], 2)}


def _count(xs: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out


def _tracer(reused: set[int], sent: dict[int, float]) -> aiohttp.TraceConfig:
    """Record reuse of a pooled connection and the time of the first body chunk, per request index."""
    tc = aiohttp.TraceConfig()

    async def on_reuse(_s: aiohttp.ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
        if ctx.trace_request_ctx:
            reused.add(ctx.trace_request_ctx["i"])

    async def on_chunk(_s: aiohttp.ClientSession, ctx: SimpleNamespace, _p: Any) -> None:
        if ctx.trace_request_ctx:
            sent.setdefault(ctx.trace_request_ctx["i"], time.perf_counter())

    tc.on_connection_reuseconn.append(on_reuse)
    tc.on_request_chunk_sent.append(on_chunk)
    return tc


async def _trace(url: str, n: int) -> dict[str, Any]:
    reused: set[int] = set()
    sent: dict[int, float] = {}
    outcome: dict[int, str] = {}
    failed_at: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout, trace_configs=[_tracer(reused, sent)]) as http:
        sem = asyncio.Semaphore(512)

        async def create() -> str:
            async with sem, http.post(f"{url}/sessions", json={}) as r:
                return str((await r.json())["session_id"])

        sids = await asyncio.gather(*(create() for _ in range(n)))
        t_idle = time.perf_counter()

        async def chat(i: int, sid: str) -> None:
            try:
                path = f"{url}/sessions/{sid}/v1/chat/completions"
                async with http.post(path, json=CHAT, trace_request_ctx={"i": i}) as r:
                    await r.read()
                    outcome[i] = str(r.status)
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcome[i] = type(exc).__name__
                failed_at.append(time.perf_counter() - t_idle)

        await asyncio.gather(*(chat(i, s) for i, s in enumerate(sids)))

        async def delete(sid: str) -> None:
            async with sem, http.delete(f"{url}/sessions/{sid}") as r:
                await r.read()

        await asyncio.gather(*(delete(s) for s in sids))
    return {
        "sessions": n,
        "reused_connections": len(reused),
        "reused_outcomes": _count([outcome[i] for i in reused]),
        "fresh_outcomes": _count([o for i, o in outcome.items() if i not in reused]),
        "reused_request_sent_after_idle_s": _spread([sent[i] - t_idle for i in reused if i in sent]),
        "failures_seen_after_idle_s": _spread(failed_at),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--cpu-hog", type=int, default=1, metavar="N")
    args = ap.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tok = str(cached_tokenizer_dir("qwen3"))
    with cpu_hogs(args.cpu_hog), sim_engine("sglang", tok, extra=["--request-latency-ms", "500"]) as eng, \
            server([f"sglang={eng}"], tok, extra=["--max-sessions", str(2 * args.sessions)]) as url:
        result = {"server_keep_alive_s": KEEP_ALIVE_S, "cpu_hogs": args.cpu_hog, **asyncio.run(_trace(url, args.sessions))}
    print(json.dumps(result), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
