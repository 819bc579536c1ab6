"""Real client libraries against a session's base_url.

Each test drives one library through a live stack (simulated engine + server), checks
the library got what it asked for, and that the trajectory's sampled ids are exactly
the engine's (its request log is the ground truth). A missing package skips cleanly;
the dev extra installs them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ..stack import live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

pytestmark = pytest.mark.asyncio

MSG = [{"role": "user", "content": "Fix the failing test."}]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {
        "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, arg in (("read_file", "path"), ("run_shell", "command"), ("search", "query"))
]


class Answer(BaseModel):
    title: str
    count: int
    tags: list[str]
    ok: bool


async def _check(stack: Any, sid: str, turns_at_least: int = 1, since: int = 0) -> None:
    """The episode finished and the trajectory equals the engine's log (entries from `since`)."""
    traj = await stack.trajectory(sid)
    log = (await stack.engine_log())[since:]
    branch = traj["branches"][-1]
    assert len(branch["turns"]) >= turns_at_least
    assert_trajectory_matches_engine(branch, log, "client")


async def test_litellm_tool_choice_and_response_format(qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    litellm = pytest.importorskip("litellm")
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        base = f"{stack.url}/sessions/{sid}/v1"
        r = await litellm.acompletion(
            model="openai/m", api_base=base, api_key="x", messages=MSG, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "search"}}, max_tokens=200,
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "search"
        assert r.choices[0].finish_reason == "tool_calls"
        await _check(stack, sid)
        sid2 = await stack.session()
        since = len(await stack.engine_log())
        r = await litellm.acompletion(
            model="openai/m", api_base=f"{stack.url}/sessions/{sid2}/v1", api_key="x", messages=MSG,
            response_format=Answer, max_tokens=200,
        )
        assert Answer.model_validate_json(r.choices[0].message.content)
        await _check(stack, sid2, since=since)


async def test_openai_agents_chat_completions_episode(qwen3_dir: Path) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        calls.append("read_file")
        return "def test(): assert 1 == 2"

    @agents.function_tool
    def run_shell(command: str) -> str:
        """Run a shell command."""
        calls.append("run_shell")
        return "1 failed"

    @agents.function_tool
    def search(query: str) -> str:
        """Search the code."""
        calls.append("search")
        return "tests/test_core.py:1"

    async with live_stack(qwen3_dir, "vllm") as stack:
        sid = await stack.session()
        client = AsyncOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x")
        agent = agents.Agent(
            name="fixer", instructions="Fix the failing test.",
            model=agents.OpenAIChatCompletionsModel(model="m", openai_client=client),
            tools=[read_file, run_shell, search],
            model_settings=agents.ModelSettings(max_tokens=300),
        )
        result = await agents.Runner.run(agent, "Fix the failing test.", max_turns=8)
        assert isinstance(result.final_output, str) and result.final_output
        assert calls, "the scripted model calls tools before answering"
        await _check(stack, sid, turns_at_least=2)


async def test_langchain_with_structured_output(qwen3_dir: Path) -> None:
    lc = pytest.importorskip("langchain_openai")
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        llm = lc.ChatOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", model="m", max_tokens=200)
        out = await llm.with_structured_output(Answer).ainvoke("Summarise the failing test.")
        assert isinstance(out, Answer)
        await _check(stack, sid)


async def test_pydantic_ai_output_type(qwen3_dir: Path) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with live_stack(qwen3_dir, "vllm") as stack:
        sid = await stack.session()
        model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x"))
        agent = Agent(model, output_type=Answer)
        result = await agent.run("Summarise the failing test.", model_settings={"max_tokens": 200})
        assert isinstance(result.output, Answer)
        await _check(stack, sid)


async def test_openai_sync_client_tool_choice_and_parse(qwen3_dir: Path) -> None:
    """The synchronous openai SDK (in a thread: the stack shares this loop): a named
    tool_choice on one session, `.parse()` on another."""
    import asyncio

    from openai import OpenAI

    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        client = OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        choice = {"type": "function", "function": {"name": "read_file"}}
        r = await asyncio.to_thread(
            client.chat.completions.create, model="m", messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=200
        )
        assert r.choices[0].message.tool_calls[0].function.name == "read_file"
        await _check(stack, sid)
        sid2 = await stack.session()
        since = len(await stack.engine_log())
        client2 = OpenAI(base_url=f"{stack.url}/sessions/{sid2}/v1", api_key="x", max_retries=0)
        parsed = await asyncio.to_thread(
            client2.chat.completions.parse, model="m", messages=MSG, response_format=Answer, max_tokens=200
        )
        assert isinstance(parsed.choices[0].message.parsed, Answer)
        await _check(stack, sid2, since=since)
