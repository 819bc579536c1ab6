"""Pause storm through the HTTP server: 200 sessions, 20 abort-mode pause/resume cycles.

The server and a simulated engine (per-token latency) run as separate
processes. Each session runs `--turns` chat turns through `/v1/chat/completions`
(its own first message, so sessions differ). First a reference run with no
pauses, then the same episodes on fresh sessions while a storm task sends
`--cycles` `POST /control/pause {"mode": "abort"}` / `POST /control/resume`
pairs spread over the reference duration. Every storm trajectory is compared
with its reference: token ids, logprobs, mask and finish reasons.

Reports lost turns (non-200), 5xx, truncated turns (finish `length` where the
reference stopped), mismatched trajectories, and the server's abort/resubmit
counters; exits non-zero unless lost, 5xx, truncated and mismatched are zero.

    python bench/pause_storm_server.py --json bench/results/pause_storm_server.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import server, sim_engine  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


async def _episode(http: aiohttp.ClientSession, url: str, i: int, turns: int, max_tokens: int,
                   stats: dict[str, int]) -> dict[str, Any] | None:
    async with http.post(f"{url}/sessions", json={}) as r:
        sid = (await r.json())["session_id"]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Task {i}: find the failing test and fix it."}]
    for _ in range(turns):
        body = {"messages": msgs, "max_tokens": max_tokens, "timeout_s": 300}
        async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
            data = await r.json()
            if r.status != 200:
                stats["lost"] += 1
                stats["5xx"] += r.status >= 500
                return None
        msg = data["choices"][0]["message"]
        msgs.append({k: v for k, v in msg.items() if v is not None})
        for tc in msg.get("tool_calls") or []:
            msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": "ok: 1 passed"})
        if not msg.get("tool_calls"):
            msgs.append({"role": "user", "content": "Continue."})
    async with http.get(f"{url}/sessions/{sid}/trajectory") as r:
        traj = await r.json()
    async with http.delete(f"{url}/sessions/{sid}") as r:
        await r.read()
    return dict(traj["branches"][0])


async def _run(url: str, n: int, turns: int, max_tokens: int, cycles: int, storm_s: float | None) -> dict[str, Any]:
    stats = {"lost": 0, "5xx": 0}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as http:
        done_cycles = 0

        async def storm() -> None:
            nonlocal done_cycles
            assert storm_s is not None
            gap = storm_s / (cycles + 1)
            for _ in range(cycles):
                await asyncio.sleep(gap * 0.7)
                async with http.post(f"{url}/control/pause", json={"mode": "abort"}) as r:
                    stats["5xx"] += r.status >= 500
                await asyncio.sleep(gap * 0.3)
                async with http.post(f"{url}/control/resume", json={}) as r:
                    stats["5xx"] += r.status >= 500
                done_cycles += 1

        task = asyncio.create_task(storm()) if storm_s else None
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_episode(http, url, i, turns, max_tokens, stats) for i in range(n)))
        wall = time.perf_counter() - t0
        if task is not None:
            await task
        async with http.get(f"{url}/control/state") as r:
            control = await r.json()
    return {"results": results, "wall_s": wall, "cycles": done_cycles, "control": control["counters"], **stats}


def _compare(ref: list[dict[str, Any] | None], got: list[dict[str, Any] | None]) -> dict[str, int]:
    out = {"mismatched": 0, "truncated": 0, "compared_tokens": 0}
    for a, b in zip(ref, got, strict=True):
        if a is None or b is None:
            continue
        fa = [t["finish_reason"] for t in a["turns"]]
        fb = [t["finish_reason"] for t in b["turns"]]
        out["truncated"] += sum(1 for x, y in zip(fa, fb, strict=False) if y == "length" and x != "length")
        same = all(a[k] == b[k] for k in ("token_ids", "logprobs", "loss_mask")) and fa == fb
        out["mismatched"] += not same
        out["compared_tokens"] += len(a["token_ids"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--latency-ms", type=float, default=3.0, help="simulated per-token latency")
    ap.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang")
    args = ap.parse_args()
    tok = str(cached_tokenizer_dir("qwen3"))
    with sim_engine(args.protocol, tok, latency_ms=args.latency_ms) as eng, server([f"{args.protocol}={eng}"], tok) as url:
        ref = asyncio.run(_run(url, args.sessions, args.turns, args.max_tokens, 0, None))
        storm = asyncio.run(_run(url, args.sessions, args.turns, args.max_tokens, args.cycles, ref["wall_s"]))
    cmp = _compare(ref["results"], storm["results"])
    out = {
        "workload": {k: getattr(args, k) for k in ("sessions", "turns", "cycles", "max_tokens", "latency_ms", "protocol")},
        "turns": args.sessions * args.turns,
        "lost_turns": storm["lost"] + ref["lost"],
        "errors_5xx": storm["5xx"] + ref["5xx"],
        "truncated_turns": cmp["truncated"],
        "mismatched_sessions": cmp["mismatched"],
        "compared_tokens": cmp["compared_tokens"],
        "cycles_completed": storm["cycles"],
        "server_counters": storm["control"],
        "wall_s": {"reference": ref["wall_s"], "storm": storm["wall_s"]},
    }
    print(json.dumps({k: v for k, v in out.items() if k != "workload"}, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    ok = out["lost_turns"] == out["errors_5xx"] == out["truncated_turns"] == out["mismatched_sessions"] == 0
    return 0 if ok and storm["cycles"] == args.cycles else 1


if __name__ == "__main__":
    sys.exit(main())
