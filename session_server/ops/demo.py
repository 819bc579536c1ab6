"""`session-server demo`: simulated engines + the server + a tool-using agent, offline.

The agent is the real `openai` client. Everything runs on 127.0.0.1 in one
process; the demo tokenizer is built by the project's own code (a small BPE with
Qwen3's special tokens and chat template), so no hub download is needed.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ..app import AppConfig
from ..context import Settings
from ..sim import running_sim
from ..sim.tokenizers import cached_tokenizer_dir
from .harness import running_server


def _tool(name: str, description: str, arg: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
        },
    }


# The tools the demo agent offers; the simulated model reads them back from the rendered
# prompt and calls them (session_server/sim/offered.py), so changing these changes its calls.
TOOLS: list[dict[str, Any]] = [
    _tool("read_file", "Read a file of the repository.", "path"),
    _tool("run_shell", "Run a shell command in the sandbox.", "command"),
    _tool("search", "Search the repository.", "query"),
]


def run_tool(name: str, arguments: str) -> str:
    """The demo environment: deterministic fake tools."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return json.dumps({"error": "arguments are not valid JSON"})
    if name == "read_file":
        return f"# {args.get('path')}\ndef main():\n    return 42\n"
    if name == "run_shell":
        return f"$ {args.get('command')}\nok: 3 passed, 0 failed"
    if name == "search":
        return json.dumps({"query": args.get("query"), "hits": ["src/app.py:12", "tests/test_core.py:40"]})
    return json.dumps({"error": f"unknown tool {name}"})


async def run_agent(base_url: str, *, max_turns: int) -> dict[str, Any]:
    """One episode through the stock openai client; returns what the agent saw."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. Use tools when they help."},
        {"role": "user", "content": "The tests fail after the config change. Find out why and fix it."},
    ]
    calls: list[str] = []
    latencies: list[float] = []
    finish = None
    try:
        for _ in range(max_turns):
            t0 = time.perf_counter()
            resp = await client.chat.completions.create(
                model="demo",
                messages=messages,  # type: ignore[arg-type]  # plain dicts, as agents send them
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=256,
                logprobs=True,
            )
            latencies.append(time.perf_counter() - t0)
            choice = resp.choices[0]
            msg = choice.message.model_dump(exclude_none=True)
            messages.append(msg)
            finish = choice.finish_reason
            if not choice.message.tool_calls:
                break
            for tc in choice.message.tool_calls:
                if tc.type != "function":  # custom (free-form) tools are not offered here
                    continue
                calls.append(f"{tc.function.name}({tc.function.arguments})")
                messages.append(
                    {"role": "tool", "tool_call_id": tc.id, "content": run_tool(tc.function.name, tc.function.arguments)}
                )
    finally:
        await client.close()
    return {"messages": messages, "tool_calls": calls, "latencies_s": latencies, "finish_reason": finish}


def _summary(traj: dict[str, Any], episode: dict[str, Any]) -> str:
    branch = traj["branches"][-1]
    ids = np.asarray(branch["token_ids"])
    mask = np.asarray(branch["loss_mask"])
    lines = [
        "TITO session server demo (simulated engine, offline)",
        f"  turns: {len(branch['turns'])}   tokens: {len(ids)}   sampled (mask=1): {int(mask.sum())}"
        f"   prompt/tool/glue (mask=0): {int((mask == 0).sum())}",
        f"  final finish_reason: {episode['finish_reason']}",
        "  per turn: prompt_start output_start output_end finish cached latency",
    ]
    for t, lat in zip(branch["turns"], episode["latencies_s"], strict=False):
        lines.append(
            f"    turn {t['index']}: {t['prompt_start']:>6} {t['output_start']:>6} {t['output_end']:>6}"
            f"  {t['finish_reason']:<10} cached={t['cached_tokens']:<6} {lat * 1000:7.1f} ms"
        )
    lines.append(f"  tool calls: {', '.join(episode['tool_calls']) or 'none'}")
    return "\n".join(lines)


async def run_demo(*, out_dir: str = "demo_output", turns: int = 8, protocol: str = "sglang", hold_s: float = 0.0) -> int:
    """The episode, its summary, and the session's page in the trajectory viewer
    (printed first, so it can be opened while the agent runs; `hold_s` keeps the server
    up that long afterwards to look at it)."""
    tok_dir = cached_tokenizer_dir("qwen3")
    async with running_sim(protocol, str(tok_dir), seed=7, dp=2, latency_ms=1.0) as engine_url:
        config = AppConfig(tokenizer=str(tok_dir), engines=[f"{protocol}={engine_url}"], settings=Settings())
        async with running_server(config) as server_url, httpx.AsyncClient(base_url=server_url) as http:
            created = (await http.post("/sessions", json={"metadata": {"demo": True}})).json()
            viewer = f"{server_url}/ui/sessions/{created['session_id']}"
            print(f"viewer: {viewer}", flush=True)
            episode = await run_agent(created["base_url"], max_turns=turns)
            traj = (await http.get(f"/sessions/{created['session_id']}/trajectory")).json()
            view = (await http.get(f"/sessions/{created['session_id']}")).json()
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            path = out / "trajectory.json"
            path.write_text(json.dumps(traj))
            print(_summary(traj, episode))
            print(f"  home target: {view['home']}   branches: {len(view['branches'])}")
            print(f"  trajectory written to {path}")
            if hold_s > 0:
                print(f"  the viewer stays up {hold_s:g} s: {viewer}", flush=True)
                await asyncio.sleep(hold_s)
            else:
                print(f"  viewer (while the demo runs; --hold-s keeps it up): {viewer}")
    return 0
