"""Kimi K2: the HTTP e2e (real `openai` client, sim engines on both protocols) for
K2-Thinking and K2, detected from the template alone and served by our KimiCodec: a tool
episode with reasoning, then a user turn after the final answer; every turn token-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from session_server.ops.demo import TOOLS, run_agent
from tests.fast.trajectory.renderer_families import BY_NAME, build
from trajectory.codec import KimiCodec, load_codec

from ..stack import live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

PROTOCOLS = ["sglang", "vllm"]
NAMES = ["kimi-k2-thinking-ids", "kimi-k2"]


@pytest.fixture(scope="module")
def kimi_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kimi-e2e")
    return {name: build(BY_NAME[name], root / "my-finetune" / name) for name in NAMES}


async def _follow_up(base_url: str, messages: list[dict[str, Any]]) -> Any:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        return await client.chat.completions.create(
            model="demo", messages=[*messages, {"role": "user", "content": "Thanks. Anything else?"}],  # type: ignore[list-item]
            tools=TOOLS, max_tokens=256, logprobs=True)  # type: ignore[arg-type]
    finally:
        await client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", NAMES)
async def test_e2e_kimi_tool_episode_with_reasoning(kimi_dirs: dict[str, Path], name: str, protocol: str) -> None:
    tag = f"{name}/{protocol}"
    assert isinstance(load_codec(str(kimi_dirs[name])), KimiCodec), tag  # detected, not named
    thinking = "thinking" in name
    async with live_stack(kimi_dirs[name], protocol) as st:
        sid = await st.session()
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        follow = await _follow_up(f"{st.url}/sessions/{sid}/v1", episode["messages"])
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert episode["tool_calls"] and episode["finish_reason"] == "stop", tag
    calls = [tc for m in episode["messages"] if m["role"] == "assistant" for tc in m.get("tool_calls") or ()]
    # the ids are what the model sampled (Kimi's format), and the client sent them back
    assert calls and all(tc["id"].startswith(f"functions.{tc['function']['name']}:") for tc in calls), tag
    answers = [m for m in episode["messages"] if m["role"] == "assistant"]
    assert all(bool(m.get("reasoning_content")) == thinking for m in answers), tag
    assert follow.choices[0].message is not None
    (branch,) = traj["branches"]  # append policy: every turn on one line, nothing re-tokenized
    assert len(branch["turns"]) == len(answers) + 1, tag
    assert_trajectory_matches_engine(branch, log, tag)
    assert all(t["extra"]["parse_status"] == "ok" for t in branch["turns"]), tag
    rewrites = [t["index"] for t in branch["turns"] if t["extra"].get("history_rewrite")]
    # K2-Thinking re-renders the final answer without its reasoning once a user turn follows:
    # kept as sampled and recorded on that turn; K2 renders what was sampled
    assert rewrites == ([len(answers)] if thinking else []), (tag, rewrites)


async def test_e2e_kimi_thinking_template_policy_forks(kimi_dirs: dict[str, Path]) -> None:
    """Under the template policy the same follow-up forks a branch from the re-render."""
    async with live_stack(kimi_dirs["kimi-k2-thinking-ids"], "sglang") as st:
        sid = await st.session(history_policy="template")
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        await _follow_up(f"{st.url}/sessions/{sid}/v1", episode["messages"])
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    first, fork = traj["branches"]
    assert_trajectory_matches_engine(first, [r for r in log][: len(first["turns"])], "template/first")
    assert len(fork["turns"]) == 1
