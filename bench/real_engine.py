"""The server in front of a real engine: what a turn costs on top of the engine's own time.

    python bench/real_engine.py --agents 32 --turns 4 --json bench/results/real_engine.json

Starts vLLM's CPU build (`.venv-vllm`, see `.ci/install-vllm`) serving the tiny
random-weight Qwen3 of the engine suite (or uses `--engine-url` / `--model-dir`), then
`session-server serve` in front of it as its own process, then `--agents` agents in a
closed loop of `--turns` chat turns each (real `openai` client, growing history,
`--max-tokens` sampled per turn). Per turn it reports the latency the agent saw; the
engine's own time is vLLM's `vllm:e2e_request_latency_seconds` (arrival to finish,
queueing in the engine included) over the same requests, read from its `/metrics`
before and after. Added latency = agent-seen mean - engine mean, per turn; the server's
CPU per turn comes from its process counters (with its children: the reply decoder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._procs import server  # noqa: E402
from tests.engine.vllm_engine import ENGINE_FLAGS, build_tiny_qwen3, vllm_server  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
_E2E = re.compile(r"^vllm:e2e_request_latency_seconds_(sum|count)\{[^}]*\}\s+([0-9.e+-]+)", re.M)


def _engine_e2e(url: str) -> tuple[float, float]:
    """(sum of seconds, requests) of vLLM's own end-to-end request latency histogram."""
    text = httpx.get(url + "/metrics", timeout=10).text
    got = {"sum": 0.0, "count": 0.0}
    for kind, value in _E2E.findall(text):
        got[kind] += float(value)
    return got["sum"], got["count"]


def _cpu_s(pid: int) -> float:
    """utime + stime of a process and its children still alive (seconds)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


async def _agent(url: str, turns: int, max_tokens: int, lat: list[float], errors: list[str]) -> None:
    from openai import AsyncOpenAI

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        sid = (await http.post("/sessions", json={})).json()["session_id"]
    agent = AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0, timeout=600)
    messages: list[Any] = [{"role": "user", "content": "Start the task."}]
    try:
        for k in range(turns):
            t0 = time.perf_counter()
            try:
                r = await agent.chat.completions.create(
                    model="m", messages=messages, max_tokens=max_tokens,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            except Exception as exc:  # counted and reported, never hidden
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            lat.append(time.perf_counter() - t0)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"Next {k}."}]
    finally:
        await agent.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@contextlib.contextmanager
def _engine(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[str, Path]]:
    if args.engine_url:
        yield args.engine_url, Path(args.model_dir)
        return
    model = build_tiny_qwen3(tmp / "tiny-qwen3")
    with vllm_server(model, tmp, extra=ENGINE_FLAGS) as engine:
        yield engine.url, model


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench._procs import PIDS

    with tempfile.TemporaryDirectory() as d, _engine(args, Path(d)) as (engine_url, model):
        with server([f"vllm={engine_url}"], str(model)) as url:
            pid = PIDS[url]
            # warm-up: one turn per agent's worth of shapes (compile caches, prefix cache of the system part)
            asyncio.run(_many(url, min(4, args.agents), 1, args.max_tokens))
            e_sum0, e_n0 = _engine_e2e(engine_url)
            cpu0, t0 = _cpu_s(pid), time.perf_counter()
            lat, errors = asyncio.run(_many(url, args.agents, args.turns, args.max_tokens))
            wall = time.perf_counter() - t0
            cpu = _cpu_s(pid) - cpu0
            e_sum1, e_n1 = _engine_e2e(engine_url)
    n_engine = e_n1 - e_n0
    engine_mean = (e_sum1 - e_sum0) / n_engine if n_engine else float("nan")
    mean = statistics.fmean(lat) if lat else float("nan")
    return {
        "agents": args.agents, "turns_per_agent": args.turns, "max_tokens": args.max_tokens,
        "turns": len(lat), "errors": len(errors), "error_samples": errors[:5], "wall_s": wall,
        "turns_per_s": len(lat) / wall if wall else 0.0, "engine_requests": n_engine,
        "turn_latency_s": {"mean": mean, "p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99)},
        "engine_e2e_mean_s": engine_mean,
        "added_latency_ms_per_turn": (mean - engine_mean) * 1000,
        "added_share": (mean - engine_mean) / mean if lat else float("nan"),
        "server_cpu_ms_per_turn": cpu / len(lat) * 1000 if lat else float("nan"),
    }


async def _many(url: str, agents: int, turns: int, max_tokens: int) -> tuple[list[float], list[str]]:
    lat: list[float] = []
    errors: list[str] = []
    await asyncio.gather(*(_agent(url, turns, max_tokens, lat, errors) for _ in range(agents)))
    return lat, errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--engine-url", help="an engine already serving --model-dir (started with ENGINE_FLAGS)")
    p.add_argument("--model-dir", help="the model the --engine-url engine serves (its tokenizer is used)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args()
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
