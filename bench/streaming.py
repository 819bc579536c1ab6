"""Real streaming: how much later than the engine's first token does the
agent see its first delta, and do the deltas add up to the committed message?

Workload: a simulated engine (`--latency-ms` per token, separate process) behind the
server (separate process); `--turns` first-turn chats, one at a time, each on a new
session, `stream: true` with logprobs (so every engine chunk is forwarded as a chunk
at once). Per turn: the agent's time to first delta (request sent -> first chunk that
carries tokens), then the same prompt ids streamed straight from the engine
(`/generate`, `stream: true`) for the engine's own time to first token; their
difference is what the server adds. Also checks that the concatenated reasoning and
content deltas equal the committed message. Writes JSON (ms p50/p99/max of both and of
the difference, `deltas_equal_committed`).

    python bench/streaming.py --json bench/results/streaming.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import server, sim_engine  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

MSGS = [{"role": "user", "content": "Fix the failing test."}]


async def _agent_turn(http: httpx.AsyncClient, max_tokens: int) -> dict[str, Any]:
    """One streamed turn: time to the first token-carrying chunk, and the text deltas."""
    sid = (await http.post("/sessions", json={})).json()["session_id"]
    body = {"model": "m", "messages": MSGS, "max_tokens": max_tokens, "stream": True, "logprobs": True}
    reasoning, content, first = [], [], None
    t0 = time.perf_counter()
    async with http.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            if first is None and (choice.get("logprobs") or choice["delta"].get("content")
                                  or choice["delta"].get("reasoning_content")):
                first = time.perf_counter() - t0
            reasoning.append(choice["delta"].get("reasoning_content") or "")
            content.append(choice["delta"].get("content") or "")
    branch = (await http.get(f"/sessions/{sid}/trajectory")).json()["branches"][0]
    turn = branch["turns"][-1]
    msg = turn["assistant_message"]
    equal = "".join(reasoning) == (msg.get("reasoning_content") or "") and "".join(content) == (msg.get("content") or "")
    return {"ttfd_s": first, "equal": equal, "prompt_ids": branch["token_ids"][: turn["output_start"]]}


async def _engine_ttft(c: httpx.AsyncClient, engine: str, prompt_ids: list[int], max_tokens: int, i: int) -> float:
    """The engine's own time to its first streamed token for the same prompt (over a
    keep-alive connection, as the agent's)."""
    body = {"rid": f"{i:032x}", "input_ids": prompt_ids, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_tokens}, "extra_key": f"bench-{i}"}
    t0 = time.perf_counter()
    async with c.stream("POST", f"{engine}/generate", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("engine stream without a frame")


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1000.0
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


async def _measure(url: str, engine: str, turns: int, max_tokens: int) -> dict[str, Any]:
    agent, eng, equal = [], [], 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http, httpx.AsyncClient(timeout=60) as direct:
        for i in range(turns):
            got = await _agent_turn(http, max_tokens)
            agent.append(got["ttfd_s"])
            equal += bool(got["equal"])
            eng.append(await _engine_ttft(direct, engine, got["prompt_ids"], max_tokens, i))
    diff = [a - e for a, e in zip(agent, eng, strict=True)]
    return {"agent_ttfd_ms": _stats(agent), "engine_ttft_ms": _stats(eng), "diff_ms": _stats(diff),
            "deltas_equal_committed": f"{equal}/{turns}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=20.0, help="the simulated engine's per-token delay")
    args = ap.parse_args()
    tok = str(cached_tokenizer_dir("qwen3"))
    with sim_engine("sglang", tok, latency_ms=args.latency_ms) as eng, server([f"sglang={eng}"], tok) as url:
        out = asyncio.run(_measure(url, eng, args.turns, args.max_tokens))
    out["workload"] = {"turns": args.turns, "max_tokens": args.max_tokens, "latency_ms": args.latency_ms,
                       "protocol": "sglang"}
    print(f"agent TTFD p50 {out['agent_ttfd_ms']['p50']:.1f} p99 {out['agent_ttfd_ms']['p99']:.1f} ms; "
          f"engine TTFT p50 {out['engine_ttft_ms']['p50']:.1f} p99 {out['engine_ttft_ms']['p99']:.1f} ms; "
          f"diff p50 {out['diff_ms']['p50']:.1f} p99 {out['diff_ms']['p99']:.1f} ms; "
          f"deltas == committed {out['deltas_equal_committed']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
