"""End to end through real HTTP with the real `openai` client against simulated engines.

The engine's own request log is the ground truth: what the trajectory says was
the prompt of turn i must be exactly the ids the engine received, and what it
says was sampled must be exactly the ids (and logprobs) the engine produced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from session_server.ops.demo import TOOLS, run_agent
from trajectory.codec import decode_text
from trajectory.export import branch_line

from ..stack import live_stack

FAMILIES = ["qwen3", "glm4moe"]
PROTOCOLS = ["sglang", "vllm"]


def assert_trajectory_matches_engine(branch: dict[str, Any], log: list[dict[str, Any]], tag: str) -> None:
    ids = np.asarray(branch["token_ids"])
    mask = np.asarray(branch["loss_mask"])
    lps = np.asarray(branch["logprobs"], dtype=np.float32)
    served = [r for r in log if r["status"] == 200]
    assert len(served) == len(branch["turns"]), tag
    expected_mask = np.zeros_like(mask)
    for turn, req in zip(branch["turns"], served, strict=True):
        a, b = turn["output_start"], turn["output_end"]
        assert ids[:a].tolist() == req["input_ids"], f"{tag}: turn {turn['index']} prompt != engine input"
        assert ids[a:b].tolist() == req["output_ids"], f"{tag}: turn {turn['index']} sampled != engine output"
        np.testing.assert_array_equal(lps[a:b], np.asarray(req["logprobs"], dtype=np.float32), err_msg=tag)
        expected_mask[a:b] = 1
    np.testing.assert_array_equal(mask, expected_mask, err_msg=f"{tag}: mask must be 1 exactly on sampled ids")
    assert np.all(lps[mask == 0] == 0.0), tag


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("family", FAMILIES)
async def test_tool_episode_trajectory_equals_engine_io(
    tokenizer_dirs: dict[str, Path], family: str, protocol: str
) -> None:
    tag = f"{family}/{protocol}"
    async with live_stack(tokenizer_dirs[family], protocol) as st:
        sid = await st.session(metadata={"task": tag})
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        assert episode["tool_calls"], f"{tag}: the scripted agent calls tools"
        assert episode["finish_reason"] == "stop", tag
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert len(traj["branches"]) == 1, tag
    branch = traj["branches"][0]
    assert len(branch["turns"]) >= 2, tag
    assert_trajectory_matches_engine(branch, log, tag)
    # the history the agent saw is what the trajectory stored
    assistant_msgs = [m for m in episode["messages"] if m["role"] == "assistant"]
    stored = [m for m in branch["messages"] if m["role"] == "assistant"]
    assert [m.get("tool_calls") for m in stored] == [m.get("tool_calls") for m in assistant_msgs], tag


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_noncanonical_segmentation_is_kept_verbatim(tokenizer_dirs: dict[str, Path], protocol: str) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dirs["qwen3"]))
    async with live_stack(tokenizer_dirs["qwen3"], protocol, noncanonical=True) as st:
        sid = await st.session()
        await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=4)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    branch = traj["branches"][0]
    assert_trajectory_matches_engine(branch, log, f"noncanonical/{protocol}")
    ids = branch["token_ids"]
    noncanonical = 0
    for t in branch["turns"]:
        sampled = ids[t["output_start"] : t["output_end"]]
        text = tok.decode(sampled, skip_special_tokens=False)
        if tok.encode(text, add_special_tokens=False) != sampled:
            noncanonical += 1
    assert noncanonical >= 1, "the simulator emitted a non-canonical segmentation the server kept"


async def test_streaming_and_logprobs_through_openai_client(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Look at the repo."}]
        resp = await client.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, max_tokens=128, logprobs=True, top_logprobs=2
        )
        choice = resp.choices[0]
        assert resp.usage is not None
        assert choice.logprobs is not None and len(choice.logprobs.content) == resp.usage.completion_tokens
        assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
        msgs.append(choice.message.model_dump(exclude_none=True))
        for tc in choice.message.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": tc.id, "content": "ok"})
        stream = await client.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, max_tokens=128, stream=True, logprobs=True, top_logprobs=2
        )
        content, reasoning, finish, calls, streamed_lps = "", "", None, [], []
        async for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or []:  # id and name first, then argument deltas (as OpenAI streams)
                if tc.index == len(calls):
                    calls.append((tc.function.name, ""))
                calls[tc.index] = (calls[tc.index][0], calls[tc.index][1] + (tc.function.arguments or ""))
            streamed_lps += c.logprobs.content if c.logprobs and c.logprobs.content else []
            finish = c.finish_reason or finish
        await client.close()
        assert finish in ("stop", "tool_calls")
        assert content or calls
        traj = await st.trajectory(sid)
        usage = resp.usage
        assert usage.prompt_tokens_details is not None
        branch = traj["branches"][0]
        turn = branch["turns"][1]
        assert turn["cached_tokens"] > 0
    # the stream carries exactly the committed turn: its text,
    # one logprob per committed sampled id with that id's exact text, the same values
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    a, b = turn["output_start"], turn["output_end"]
    ids, lps = branch["token_ids"][a:b], branch["logprobs"][a:b]
    assert [t.token for t in streamed_lps] == [decode_text(tok, [i]) for i in ids]
    np.testing.assert_allclose([t.logprob for t in streamed_lps], lps, rtol=1e-6)
    assert all(len(t.top_logprobs) == 2 for t in streamed_lps)
    stored = branch["messages"][-1]
    assert stored["role"] == "assistant"
    assert content == (stored.get("content") or "") and reasoning == (stored.get("reasoning_content") or "")
    assert calls == [(tc["function"]["name"], tc["function"]["arguments"]) for tc in stored.get("tool_calls") or []]
    assert "".join(t.token for t in streamed_lps) == decode_text(tok, ids)


async def test_retry_of_last_turn_rolls_back_to_a_new_branch(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        first = [{"role": "user", "content": "Start."}]
        r1 = await st.chat(sid, {"messages": first, "max_tokens": 64, "tools": TOOLS})
        assert r1.status_code == 200
        m1 = r1.json()["choices"][0]["message"]
        second = [*first, m1, *[{"role": "tool", "tool_call_id": tc["id"], "content": "x"} for tc in m1.get("tool_calls") or []]]
        if not m1.get("tool_calls"):
            second.append({"role": "user", "content": "More."})
        assert (await st.chat(sid, {"messages": second, "max_tokens": 64, "tools": TOOLS})).status_code == 200
        # the agent retries turn 2 (same request again): rollback to checkpoint 1
        assert (await st.chat(sid, {"messages": second, "max_tokens": 64, "tools": TOOLS})).status_code == 200
        traj = await st.trajectory(sid)
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert len(traj["branches"]) == 2
    old, new = traj["branches"]
    assert new["parent_id"] == old["id"] and new["reason"] == "rollback"
    cut = old["turns"][0]["end"]
    # the new branch shares the first turn (exported once, on the parent) and adds its own
    assert new["fork_index"] == cut and new["fork_checkpoint"] == 1
    line = branch_line(traj, new["id"])
    assert line["token_ids"][:cut] == old["token_ids"][:cut]
    assert len(line["turns"]) == 2 and len(new["turns"]) == 1 and len(old["turns"]) == 2
    assert view["active_branch"] == new["id"]
