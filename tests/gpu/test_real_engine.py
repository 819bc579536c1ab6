"""Against a real SGLang or vLLM engine: skipped unless one is named.

    SESSION_SERVER_GPU_ENGINE=sglang=http://gpu-node:30000 \\
    SESSION_SERVER_GPU_TOKENIZER=Qwen/Qwen3-8B \\
    python -m pytest tests/gpu -q

The engine must serve the model whose tokenizer is named (loaded with
`AutoTokenizer.from_pretrained`). These tests check what the simulator cannot:
that a real engine's ids, logprobs and cache counters pass strict validation,
that the session's tokens are exactly what the engine saw, and that pausing and
resuming the real engine mid-turn loses nothing.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import numpy as np
import pytest

ENGINE = os.environ.get("SESSION_SERVER_GPU_ENGINE")
TOKENIZER = os.environ.get("SESSION_SERVER_GPU_TOKENIZER")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ENGINE and TOKENIZER), reason="set SESSION_SERVER_GPU_ENGINE and SESSION_SERVER_GPU_TOKENIZER"),
]

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


async def _stack() -> Any:
    from session_server.app import AppConfig
    from session_server.context import Settings
    from session_server.ops.harness import running_server

    assert ENGINE and TOKENIZER
    return running_server(AppConfig(tokenizer=TOKENIZER, engines=[ENGINE], settings=Settings()))


async def test_two_turn_episode_is_token_exact_and_cached() -> None:
    from openai import AsyncOpenAI

    async with await _stack() as url, httpx.AsyncClient(base_url=url, timeout=600) as http:
        sid = (await http.post("/sessions", json={"sampling": {"temperature": 0.7}})).json()["session_id"]
        client = AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Read README.md with the tool, then summarise it."}]
        for _ in range(2):
            r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=256, logprobs=True)
            msg = r.choices[0].message
            msgs.append(msg.model_dump(exclude_none=True))
            for tc in msg.tool_calls or []:
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": "# Project\nA session server."})
            if not msg.tool_calls:
                msgs.append({"role": "user", "content": "Shorter, please."})
        await client.close()
        traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
    branch = traj["branches"][-1]
    ids, mask, lps = (np.asarray(branch[k]) for k in ("token_ids", "loss_mask", "logprobs"))
    sampled = sum(t["output_end"] - t["output_start"] for t in branch["turns"])
    assert int(mask.sum()) == sampled and np.all(lps[mask == 0] == 0) and np.all(lps[mask == 1] <= 1e-6)
    t1 = branch["turns"][1]
    assert t1["cached_tokens"] > 0, "the second turn reused the first turn's KV on its home rank"


async def test_pause_abort_resume_mid_turn_completes() -> None:
    async with await _stack() as url, httpx.AsyncClient(base_url=url, timeout=600) as http:
        sid = (await http.post("/sessions", json={})).json()["session_id"]
        body = {"messages": [{"role": "user", "content": "Count from 1 to 200, one number per line."}], "max_tokens": 600}
        chat = asyncio.create_task(http.post(f"/sessions/{sid}/v1/chat/completions", json=body))
        await asyncio.sleep(1.0)
        pause = await http.post("/control/pause", json={"mode": "abort"})
        assert pause.status_code == 200, pause.text
        await asyncio.sleep(0.5)
        assert (await http.post("/control/resume", json={})).status_code == 200
        r = await chat
        assert r.status_code == 200, r.text
        state = (await http.get("/control/state")).json()
        turn = (await http.get(f"/sessions/{sid}/trajectory")).json()["branches"][-1]["turns"][0]
        assert turn["output_end"] > turn["output_start"]
        assert state["counters"]["pauses"] == 1
