"""Each committed turn says which agent and thread asked for it (`lineage`), read from
what real clients send through real HTTP: the client's own `x-tito-*` labels, the
headers and body fields harnesses send (Claude Code's agent id and session, Codex's
sub-agent and turn metadata, `prompt_cache_key`, Anthropic `metadata.user_id`); a bad
label is a 400 naming the header, in the client's own error shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from ..stack import live_stack

MSG = [{"role": "user", "content": "Fix the failing test."}]


def _turns(traj: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Every turn's lineage, in commit order."""
    turns = [t for b in traj["branches"] for t in b["turns"]]
    return [t["lineage"] for t in sorted(turns, key=lambda t: t["seq"])]


async def test_openai_chat_and_responses_turns_carry_the_agent_and_thread_the_client_named(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "sglang") as st:
        sid = await st.session()
        base = f"{st.url}/sessions/{sid}/v1"
        main = AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                           default_headers={"x-tito-agent": "main", "x-tito-thread": "t-main"})
        await main.chat.completions.create(model="m", messages=MSG, max_tokens=8)  # type: ignore[arg-type]
        bare = AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
        await bare.chat.completions.create(
            model="m", messages=MSG, max_tokens=8,  # type: ignore[arg-type]
            extra_headers={"x-tito-agent": "explorer", "x-tito-parent": "t-main", "x-tito-thread": "t-sub"})
        await bare.responses.create(model="m", input="Summarise.", max_output_tokens=8, store=False,
                                    extra_headers={"x-openai-subagent": "compact", "thread-id": "th-1"})
        await bare.responses.create(model="m", input="Go on.", max_output_tokens=8, store=False,
                                    extra_body={"prompt_cache_key": "th-2"})
        await bare.chat.completions.create(model="m", messages=MSG, max_tokens=8)  # type: ignore[arg-type]
        traj = await st.trajectory(sid)
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert _turns(traj) == [
        {"agent": "main", "kind": "main", "thread": "t-main", "parent": None, "source": "x-tito-agent"},
        {"agent": "explorer", "kind": "subagent", "thread": "t-sub", "parent": "t-main", "source": "x-tito-agent"},
        {"agent": "compact", "kind": "side", "thread": "th-1", "parent": None, "source": "x-openai-subagent"},
        {"agent": "main", "kind": "main", "thread": "th-2", "parent": None, "source": "prompt_cache_key"},
        None,  # the client said nothing
    ]
    agents = [(a["agent"], a["kind"], a["thread"], a["turns"]) for a in view["agents"]]
    assert agents == [("main", "main", "t-main", 1), ("explorer", "subagent", "t-sub", 1),
                      ("compact", "side", "th-1", 1), ("main", "main", "th-2", 1), (None, None, None, 1)]
    assert view["agents"][1]["parent"] == "t-main"


CLAUDE_USER_ID = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "9bc9ccb4-f96c-479f"})


async def test_anthropic_turns_carry_claude_codes_session_and_sub_agent(qwen3_dir: Path) -> None:
    """As Claude Code 2.1.197 sends them: `metadata.user_id` (JSON naming its session) on
    every request, `x-claude-code-session-id` likewise, `x-claude-code-agent-id` only on a
    sub-agent's requests."""
    async with live_stack(qwen3_dir, "sglang") as st:
        sid = await st.session()
        client = AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0)
        meta: Any = {"user_id": CLAUDE_USER_ID}
        await client.messages.create(model="m", max_tokens=8, messages=MSG, metadata=meta)  # type: ignore[arg-type]
        await client.messages.create(model="m", max_tokens=8, messages=MSG,  # type: ignore[arg-type]
                                     extra_headers={"x-claude-code-session-id": "9bc9ccb4-f96c-479f"})
        await client.messages.create(model="m", max_tokens=8, messages=MSG, metadata=meta,  # type: ignore[arg-type]
                                     extra_headers={"x-claude-code-session-id": "9bc9ccb4-f96c-479f",
                                                    "x-claude-code-agent-id": "a25eedc37e4c0255f"})
        traj = await st.trajectory(sid)
    assert _turns(traj) == [
        {"agent": "main", "kind": "main", "thread": "9bc9ccb4-f96c-479f", "parent": None, "source": "metadata.user_id"},
        {"agent": "main", "kind": "main", "thread": "9bc9ccb4-f96c-479f", "parent": None,
         "source": "x-claude-code-session-id"},
        {"agent": "a25eedc37e4c0255f", "kind": "subagent", "thread": "a25eedc37e4c0255f",
         "parent": "9bc9ccb4-f96c-479f", "source": "x-claude-code-agent-id"},
    ]


@pytest.mark.parametrize(("header", "value"), [("x-tito-agent", "x" * 257), ("x-tito-thread", "tab\there"),
                                               ("x-tito-agent-kind", "boss"), ("x-tito-parent", "p" * 300)])
async def test_a_bad_lineage_header_is_a_400_naming_it_and_commits_nothing(
        qwen3_dir: Path, header: str, value: str) -> None:
    headers = {header: value} if header in ("x-tito-agent", "x-tito-thread") else {header: value, "x-tito-agent": "a"}
    async with live_stack(qwen3_dir, "sglang") as st:
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as chat_err:
            await oai.chat.completions.create(model="m", messages=MSG, max_tokens=8,  # type: ignore[arg-type]
                                              extra_headers=headers)
        ant = AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as msg_err:
            await ant.messages.create(model="m", max_tokens=8, messages=MSG,  # type: ignore[arg-type]
                                      extra_headers=headers)
        traj = await st.trajectory(sid)
    assert f"header {header}" in chat_err.value.message
    assert msg_err.value.body["type"] == "error" and f"header {header}" in msg_err.value.body["error"]["message"]  # type: ignore[index]
    assert sum(len(b["turns"]) for b in traj["branches"]) == 0


@pytest.mark.parametrize("header", ["session-id", "thread-id", "x-claude-code-agent-id", "x-claude-code-session-id"])
async def test_a_malformed_header_of_another_party_is_skipped_not_refused(qwen3_dir: Path, header: str) -> None:
    """`session-id` and the like are common names a proxy may send for its own purposes:
    a value we cannot keep as a label is left out, and the turn is served (labelled from
    what else the request says, here nothing)."""
    async with live_stack(qwen3_dir, "sglang") as st:
        sid = await st.session()
        oai = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        r = await oai.chat.completions.create(model="m", messages=MSG, max_tokens=8,  # type: ignore[arg-type]
                                              extra_headers={header: "z" * 300})
        traj = await st.trajectory(sid)
    assert r.choices[0].message is not None
    assert [t["lineage"] for b in traj["branches"] for t in b["turns"]] == [None]
