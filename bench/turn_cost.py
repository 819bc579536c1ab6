"""CPU per turn: what one small turn costs the `serve` process, read from its own counters.

A simulated engine with no latency, in its own process, and `--agents` clients in a
closed loop, each on its own session: every turn resends the whole history (the last
reply plus a new user message) and asks for `--max-tokens` sampled tokens, as an
agent does. After `--warmup` turns per agent, the server's CPU time (utime + stime of
the `serve` process and every child it runs, e.g. the reply decoder, from /proc) is
read before and after `--turns` more turns per agent; CPU ms per turn is the
difference over the turns committed. The median of `--runs` runs is reported.

    python bench/turn_cost.py --family qwen3 --json bench/results/turn_cost_qwen3.json

Large replies: `--padding floats` makes the engine add the routed-experts payload that
`responsiveness.py` uses (900 rows x 256 floats as nested JSON lists, ~1.36 MB) to every
reply (`base64`: the same as one string), so each turn costs the server the decoding of
a 1.36 MB reply. Each turn is slower, so fewer agents keep a run short:

    python bench/turn_cost.py --family qwen3 --padding floats --agents 16 \
        --json bench/results/turn_cost_qwen3_floats.json

Codec family: by default the server detects ours from the template. `--codec renderers`
starts it with `--template-family renderers:NAME`, NAME being the renderers family that
`ours_vs_renderers.py` pairs with the tokenizer (qwen3 -> qwen3, glm4moe -> glm-4.5;
llama3's is refused at load). `--server-arg=--flag=value` (repeatable; the `=` keeps
argparse from reading the value as one of ours) passes any other `serve` flag. The
JSON's `codec_family` is the family the server resolves, checked here with the same
code and arguments:

    python bench/turn_cost.py --family qwen3 --json bench/results/turn_cost_qwen3.json
    python bench/turn_cost.py --family qwen3 --codec renderers \
        --json bench/results/turn_cost_qwen3_renderers.json

The engine's and the clients' CPU are not counted: they stand in for other machines
(the clients still share the cores, so turns/s is a lower bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import PIDS, descendants, process_cpu_s, server, sim_engine  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402
from session_server.sim.wire import padding_payload  # noqa: E402


def server_cpu_s(pid: int) -> float:
    """CPU seconds of the server process and every live process below it."""
    return process_cpu_s(pid) + sum(process_cpu_s(c) for c in descendants(pid))


async def _agent(http: aiohttp.ClientSession, url: str, turns: int, max_tokens: int,
                 start: asyncio.Event, done: list[int], latencies: list[float] | None = None,
                 kept: list[str] | None = None) -> None:
    """One session: `turns` turns after `start` is set, history growing by two messages.
    With `latencies`, each turn's wall time (request sent -> reply read) is appended; with
    `kept`, the session is left open and its id appended (else it is deleted)."""
    async with http.post(f"{url}/sessions", json={}) as r:
        r.raise_for_status()
        sid = (await r.json())["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Start the task."}]
    await start.wait()
    for k in range(turns):
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens}
        t0 = time.perf_counter()
        async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            reply = (await r.json())["choices"][0]["message"]
        if latencies is not None:
            latencies.append(time.perf_counter() - t0)
        messages = [*messages, {"role": "assistant", "content": reply.get("content") or ""},
                    {"role": "user", "content": f"Go on with step {k + 1}."}]
        done[0] += 1
    if kept is not None:
        kept.append(sid)
        return
    async with http.delete(f"{url}/sessions/{sid}") as r:
        r.raise_for_status()


async def _phase(url: str, agents: int, turns: int, max_tokens: int, latencies: list[float] | None = None,
                 kept: list[str] | None = None) -> int:
    done = [0]
    start = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=agents)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        tasks = [asyncio.create_task(_agent(http, url, turns, max_tokens, start, done, latencies, kept))
                 for _ in range(agents)]
        await asyncio.sleep(0)
        start.set()
        await asyncio.gather(*tasks)
    return done[0]


def one_run(tokenizer: str, protocol: str, agents: int, warmup: int, turns: int, max_tokens: int,
            engine_args: list[str], server_args: list[str]) -> dict[str, Any]:
    """A fresh engine and server; warm-up turns, then the measured ones."""
    with sim_engine(protocol, tokenizer, extra=engine_args) as engine, \
            server([engine], tokenizer, extra=server_args) as url:
        pid = PIDS[url]
        asyncio.run(_phase(url, agents, warmup, max_tokens))
        cpu0, main0, t0 = server_cpu_s(pid), process_cpu_s(pid), time.monotonic()
        n = asyncio.run(_phase(url, agents, turns, max_tokens))
        cpu, main, wall = server_cpu_s(pid) - cpu0, process_cpu_s(pid) - main0, time.monotonic() - t0
    return {"turns": n, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "cpu_ms_per_turn": round(1000 * cpu / n, 3),
            "main_process_cpu_ms_per_turn": round(1000 * main / n, 3),  # its threads, not its children
            "turns_per_s": round(n / wall, 1)}


def renderers_family(family: str) -> str:
    """`renderers:NAME` for a simulator tokenizer, NAME as `ours_vs_renderers.py` pairs them."""
    from bench.ours_vs_renderers import PAIRS

    if family not in PAIRS:
        raise SystemExit(f"no renderers family is paired with {family!r}; known: {', '.join(PAIRS)}")
    return f"renderers:{PAIRS[family]}"


def resolved_family(tokenizer: str, server_args: list[str]) -> str:
    """The codec family the server will run, resolved as it does at start-up (the last
    --template-family/--family among `server_args`, else detection), so a result says
    which codec it measured; a name the server would refuse fails here first."""
    from transformers import AutoTokenizer

    from trajectory.codec import resolve_family

    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--template-family", "--family", dest="family", default=None)
    forced = flags.parse_known_args(server_args)[0].family
    return str(resolve_family(AutoTokenizer.from_pretrained(tokenizer), forced).describe())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3", help="a simulator tokenizer family (sim/tokenizers.py)")
    ap.add_argument("--protocol", default="sglang", choices=("sglang", "vllm"))
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3, help="turns per agent before measuring")
    ap.add_argument("--turns", type=int, default=10, help="measured turns per agent")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--padding", choices=("none", "floats", "base64"), default="none",
                    help="the routed-experts payload the engine adds to every reply (floats: ~1.36 MB)")
    ap.add_argument("--codec", choices=("ours", "renderers"), default="ours",
                    help="ours: the family detected from the template; renderers: the paired renderers family")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="an extra `serve` argument (repeatable; write it as --server-arg=--flag=value)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tokenizer = str(cached_tokenizer_dir(args.family))
    engine_args = [] if args.padding == "none" else ["--padding", args.padding]
    template_family = renderers_family(args.family) if args.codec == "renderers" else None
    server_args = [*(["--template-family", template_family] if template_family else []), *args.server_arg]
    codec_family = resolved_family(tokenizer, server_args)
    print(f"codec family: {codec_family}", file=sys.stderr, flush=True)
    runs = [one_run(tokenizer, args.protocol, args.agents, args.warmup, args.turns, args.max_tokens,
                    engine_args, server_args)
            for _ in range(args.runs)]
    result = {
        "family": args.family, "protocol": args.protocol, "agents": args.agents, "max_tokens": args.max_tokens,
        "turns_per_agent": args.turns, "padding": args.padding,
        "reply_padding_bytes": len(padding_payload(args.padding)) if args.padding != "none" else 0,
        "codec": args.codec, "codec_family": codec_family, "server_args": server_args, "runs": runs,
        "median_cpu_ms_per_turn": statistics.median(r["cpu_ms_per_turn"] for r in runs),
        "median_main_process_cpu_ms_per_turn": statistics.median(r["main_process_cpu_ms_per_turn"] for r in runs),
        "median_turns_per_s": statistics.median(r["turns_per_s"] for r in runs),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
