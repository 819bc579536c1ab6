"""GLM ends a turn by sampling the next role token. When the agent's next message has
another role than the one sampled (tool calls answered by a user message), the next
prompt must never carry two role tokens in a row: the turn forks (both policies), the
sampled role token stays in the record with mask 1, and the fork names why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from session_server.ops.demo import TOOLS

from ..stack import live_stack

SYSTEM = {"role": "system", "content": "You are a careful engineer."}
USER = {"role": "user", "content": "Fix the failing test."}
NEVER_MIND = {"role": "user", "content": "Never mind, stop here."}


async def _script(st: Any, *turns: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{st.engines[0]}/sim/script", json={"turns": list(turns)})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("policy", ["append", "template"])
async def test_user_after_sampled_observation_forks_without_two_role_tokens(
    tokenizer_dirs: dict[str, Path], policy: str
) -> None:
    d = tokenizer_dirs["glm4moe"]
    tok = AutoTokenizer.from_pretrained(str(d))
    obs, user_tok = tok.convert_tokens_to_ids("<|observation|>"), tok.convert_tokens_to_ids("<|user|>")
    call = {"name": TOOLS[0]["function"]["name"], "arguments": {"path": "a.py"}}
    async with live_stack(d) as st:
        await _script(st, {"content": "", "tool_calls": [call]}, {"content": "Stopped."})
        sid = await st.session(history_policy=policy)
        r = await st.chat(sid, {"model": "m", "messages": [SYSTEM, USER], "tools": TOOLS, "max_tokens": 200})
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]
        assert reply["tool_calls"]
        before = (await st.trajectory(sid))["branches"][-1]
        turn0 = before["turns"][0]
        end = turn0["output_end"]
        assert before["token_ids"][end - 1] == obs and before["loss_mask"][end - 1] == 1
        r = await st.chat(sid, {"model": "m", "messages": [SYSTEM, USER, reply, NEVER_MIND],
                                "tools": TOOLS, "max_tokens": 200})
        assert r.status_code == 200, r.text
        prompt = list((await st.engine_log())[-1]["input_ids"])
        traj = await st.trajectory(sid)
        view = (await st.http.get(f"/sessions/{sid}")).json()
        samples = (await st.http.get(f"/sessions/{sid}/samples")).json()
    text = tok.decode(prompt, skip_special_tokens=False)
    assert "<|observation|><|user|>" not in text
    assert all(not (a == obs and b == user_tok) for a, b in zip(prompt, prompt[1:], strict=False))
    # the template's own render of the whole history is what the model saw
    full = tok.apply_chat_template([SYSTEM, USER, {**reply, "tool_calls": [
        {**reply["tool_calls"][0], "function": {**reply["tool_calls"][0]["function"],
                                                "arguments": {"path": "a.py"}}}]}, NEVER_MIND],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == full
    # the sampled turn is kept, exactly as sampled, on the branch it was committed to
    old = next(b for b in traj["branches"] if b["id"] == before["id"])
    assert old["token_ids"] == before["token_ids"] and old["loss_mask"][end - 1] == 1
    new = traj["branches"][-1]
    assert new["id"] != before["id"] and new["reason"] == "role_mismatch"
    forks = [d for d in view["diagnostics"] if d["kind"] == "fork"]
    assert forks and forks[-1]["reason"] == "role_mismatch"
    assert "<|observation|>" in forks[-1]["detail"] and "<|user|>" in forks[-1]["detail"]
    # the new branch shares the old one's prompt up to its first sampled token (the sampled
    # tokens are prompt, mask 0, on the new branch: never shared)
    assert (new["fork_checkpoint"], new["fork_index"]) == (0, turn0["output_start"])
    assert forks[-1]["shared_tokens"] == turn0["output_start"] and new["token_ids"][0] == prompt[new["fork_index"]]
    # both lines are trained: the sampled role token stays a mask-1 token of a kept sample
    kept = [smp for smp in samples["samples"] if smp["path"][-1] == before["id"]]
    assert len(samples["samples"]) == 2 and len(kept) == 1
    assert kept[0]["token_ids"][end - 1] == obs and kept[0]["loss_mask"][end - 1] == 1
