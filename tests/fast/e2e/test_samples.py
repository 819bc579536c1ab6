"""Training samples end to end with the real `openai` client: a session with a tool-call id
rename, a sub-agent interleave and a retry; the samples match the expected tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from openai import AsyncOpenAI

from session_server.client import AsyncSessionClient
from session_server.ops.demo import TOOLS

from ..stack import live_stack


def _renamed(message: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The assistant message as an SDK that mints its own tool-call ids re-sends it."""
    calls = [{**tc, "id": f"{prefix}_{i}"} for i, tc in enumerate(message.get("tool_calls") or [])]
    return {**message, "tool_calls": calls}


def _results(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": tc["id"], "content": "done"} for tc in message["tool_calls"]]


async def test_e2e_rename_sub_agent_and_retry_give_the_expected_samples(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        client = AsyncSessionClient(st.url)
        sid = await client.create_session(metadata={"task": "fix-bug-17"})
        oai = AsyncOpenAI(base_url=client.openai_base_url(sid), api_key="x", max_retries=0)

        async def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
            r = await oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=96)
            return r.choices[0].message.model_dump(exclude_none=True)

        main = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix bug 17."}]
        first = await ask(main)  # turn 0, branch 0
        assert first.get("tool_calls"), "the simulated agent opens with tool calls"
        sent = _renamed(first, "sdk")
        main = [*main, sent, *_results(sent)]

        sub = [{"role": "system", "content": "You read logs."}, {"role": "user", "content": "Summarise the log."}]
        await ask(sub)  # a sub-agent in the same session: its own line (branch 1)

        await ask(main)  # the main agent resumes, ids renamed: extends branch 0
        await ask(main)  # ... and retries that turn: a new branch from checkpoint 1

        view = await client.session(sid)
        traj = await client.trajectory(sid)
        latest = await client.samples(sid)  # safetensors, the default picker
        every = await client.samples(sid, picker="all", format="json")
        await client.set_reward(sid, 1.0)
        rewarded = await client.batch_samples([sid], close=True, format="npz")

    branches = {b["id"]: b for b in traj["branches"]}
    assert len(branches) == 3 and view["active_branch"] == 2
    assert (branches[1]["parent_id"], branches[1]["fork_checkpoint"]) == (0, 0)  # the sub-agent
    assert (branches[2]["parent_id"], branches[2]["fork_checkpoint"], branches[2]["reason"]) == (0, 1, "rollback")
    assert len(branches[0]["turns"]) == 2  # the rename did not fork: the resumed turn is on branch 0
    renames = branches[0]["turns"][1]["extra"]["tool_call_id_renames"]
    assert renames == {f"sdk_{i}": tc["id"] for i, tc in enumerate(first["tool_calls"])}
    assert branches[2]["turns"][0]["extra"]["tool_call_id_renames"] == renames
    # branch 0's second turn was retried: the default picker keeps the sub-agent and the retry
    assert [s.path for s in latest] == [[0, 1], [0, 2]]
    assert [s.path for s in every] == [[0], [0, 1], [0, 2]]
    main_line, sub_line = latest[1], latest[0]
    assert sub_line.num_trainable > 0 and main_line.num_trainable > 0
    # the retry's line trains turn 0 (shared with the abandoned line, which is not a sample)
    first_turn = main_line.turn_boundaries[0]
    assert main_line.loss_mask[first_turn[1] : first_turn[2]].all()
    # under `all`, the shared turn 0 is trained in exactly one sample (the earliest)
    trained = [int(s.loss_mask[: s.turn_boundaries[0][2]].sum()) for s in every if s.path[-1] != 1]
    assert sorted(trained) == [0, first_turn[2] - first_turn[1]]
    for s in latest:
        assert s.metadata["task"] == "fix-bug-17" and s.metadata["session_id"] == sid
        assert s.status == "completed" or s.status == "truncated"
        assert np.all(s.logprobs[s.loss_mask == 0] == 0)
    assert [s.reward for s in rewarded] == [1.0, 1.0]
    assert [s.path for s in rewarded] == [[0, 1], [0, 2]]
