"""The server in front of a real engine: what a turn costs on top of the engine's own time.

    python bench/real_engine.py --agents 32 --turns 4 --json bench/results/real_engine.json

Starts vLLM's CPU build (`.venv-vllm`, see `.ci/install-vllm`) serving the tiny
random-weight Qwen3 of the engine suite (or uses `--engine-url` / `--model-dir`), then
`session-server serve` in front of it as its own process, then `--agents` agents in a
closed loop of `--turns` chat turns each (real `openai` client, growing history,
`--max-tokens` sampled per turn). Per turn it reports the latency the agent saw, and
two references for the engine's own time over the same requests:

- `engine_e2e`: vLLM's `vllm:e2e_request_latency_seconds` (arrival at its engine core
  to finish, queueing included), from its `/metrics` before and after; it leaves out
  vLLM's own HTTP front end;
- `direct`: the same agents (count, turns, tokens per turn, growing context) sending
  token ids straight to vLLM's `/inference/v1/generate`, measured as a client sees it.

Added latency per turn = the agent-seen mean through the server - the direct mean (the
server's share), and - the engine's e2e mean (the server plus vLLM's front end). The
legs alternate `--repeat` times (direct, server, ...); medians are reported. The
server's CPU per turn comes from its process counters (with its children: the reply
decoder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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

from bench._procs import descendants, process_cpu_s, server  # noqa: E402
from tests.engine.vllm_engine import ENGINE_FLAGS, build_tiny_qwen3, vllm_server  # noqa: E402

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
    return sum(process_cpu_s(p) for p in [pid, *descendants(pid)])


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


async def _direct_agent(engine: str, model: str, prompt: list[int], turns: int, max_tokens: int,
                        lat: list[float], errors: list[str]) -> None:
    """One agent without the server: its context grows by what was sampled plus a short
    user turn (the ids of one rendered user message), as a session's would."""
    import itertools

    ids = list(prompt)
    rid = itertools.count()
    async with httpx.AsyncClient(base_url=engine, timeout=600) as http:
        for _ in range(turns):
            body = {"request_id": f"direct-{id(lat)}-{id(ids)}-{next(rid)}", "model": model, "token_ids": ids,
                    "sampling_params": {"max_tokens": max_tokens, "logprobs": 1, "skip_special_tokens": False,
                                        "include_stop_str_in_output": True, "stop_token_ids": [151645, 151643]}}
            t0 = time.perf_counter()
            r = await http.post("/inference/v1/generate", json=body)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                return
            lat.append(time.perf_counter() - t0)
            ids += r.json()["choices"][0]["token_ids"] + prompt[-12:]


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


def _server_leg(args: argparse.Namespace, url: str, pid: int, engine_url: str) -> dict[str, Any]:
    e_sum0, e_n0 = _engine_e2e(engine_url)
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    lat, errors = asyncio.run(_many(url, args.agents, args.turns, args.max_tokens))
    wall = time.perf_counter() - t0
    cpu = _cpu_s(pid) - cpu0
    e_sum1, e_n1 = _engine_e2e(engine_url)
    n_engine = e_n1 - e_n0
    return {"turns": len(lat), "errors": errors, "wall_s": wall, "mean_s": statistics.fmean(lat) if lat else float("nan"),
            "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99),
            "engine_e2e_mean_s": (e_sum1 - e_sum0) / n_engine if n_engine else float("nan"),
            "cpu_ms_per_turn": cpu / len(lat) * 1000 if lat else float("nan")}


def _direct_leg(args: argparse.Namespace, engine_url: str, model: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Start the task."}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False,
                                          enable_thinking=False))
    served = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    lat: list[float] = []
    errors: list[str] = []

    async def many() -> None:
        await asyncio.gather(*(_direct_agent(engine_url, served, prompt, args.turns, args.max_tokens, lat, errors)
                               for _ in range(args.agents)))

    t0 = time.perf_counter()
    asyncio.run(many())
    wall = time.perf_counter() - t0
    return {"turns": len(lat), "errors": errors, "wall_s": wall, "mean_s": statistics.fmean(lat) if lat else float("nan"),
            "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench._procs import PIDS

    legs: dict[str, list[dict[str, Any]]] = {"direct": [], "server": []}
    with tempfile.TemporaryDirectory() as d, _engine(args, Path(d)) as (engine_url, model):
        with server([f"vllm={engine_url}"], str(model)) as url:
            asyncio.run(_many(url, min(4, args.agents), 1, args.max_tokens))  # warm-up (compile caches)
            for _ in range(args.repeat):
                legs["direct"].append(_direct_leg(args, engine_url, model))
                legs["server"].append(_server_leg(args, url, PIDS[url], engine_url))

    def med(leg: str, key: str) -> float:
        return statistics.median(r[key] for r in legs[leg])

    server_mean, direct_mean, e2e = med("server", "mean_s"), med("direct", "mean_s"), med("server", "engine_e2e_mean_s")
    errors = [e for leg in legs.values() for r in leg for e in r["errors"]]
    return {
        "agents": args.agents, "turns_per_agent": args.turns, "max_tokens": args.max_tokens, "repeat": args.repeat,
        "errors": len(errors), "error_samples": errors[:5],
        "server": {"mean_s": server_mean, "p50_s": med("server", "p50_s"), "p99_s": med("server", "p99_s"),
                   "turns_per_s": statistics.median(r["turns"] / r["wall_s"] for r in legs["server"]),
                   "cpu_ms_per_turn": med("server", "cpu_ms_per_turn")},
        "direct": {"mean_s": direct_mean, "p50_s": med("direct", "p50_s"), "p99_s": med("direct", "p99_s"),
                   "turns_per_s": statistics.median(r["turns"] / r["wall_s"] for r in legs["direct"])},
        "engine_e2e_mean_s": e2e,
        "added_ms_per_turn_vs_direct": (server_mean - direct_mean) * 1000,
        "added_ms_per_turn_vs_engine_e2e": (server_mean - e2e) * 1000,
        "legs": {k: [{kk: vv for kk, vv in r.items() if kk != "errors"} for r in v] for k, v in legs.items()},
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
    p.add_argument("--repeat", type=int, default=3, help="direct/server leg pairs, alternated (medians reported)")
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
