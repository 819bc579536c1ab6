"""A request that leaves the committed line for a known client habit says why in the
session's diagnostics: an agent that inlines the reasoning we returned in
`reasoning_content` into its content as `<think>...</think>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from ..stack import live_stack

USER = {"role": "user", "content": "Fix the failing test."}
MORE = {"role": "user", "content": "And the other one?"}


async def _script(st: Any, *turns: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{st.engines[0]}/sim/script", json={"turns": list(turns)})
        assert r.status_code == 200, r.text


def _inlined(reply: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": f"<think>\n{reply['reasoning_content']}\n</think>\n\n{reply['content']}"}


async def test_inlined_reasoning_fork_names_its_cause(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        await _script(st, *[{"content": f"Done {i}.", "reasoning_content": f"Think {i}."} for i in range(5)])
        sid = await st.session()
        r = await st.chat(sid, {"model": "m", "messages": [USER], "max_tokens": 64})
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]
        assert reply["reasoning_content"] == "Think 0." and reply["content"] == "Done 0."
        r = await st.chat(sid, {"model": "m", "messages": [USER, _inlined(reply), MORE], "max_tokens": 64})
        assert r.status_code == 200, r.text
        view = (await st.http.get(f"/sessions/{sid}")).json()
        # a later turn's message inlined: a retry from the checkpoint before it, noted too
        other = await st.session()
        r = await st.chat(other, {"model": "m", "messages": [USER], "max_tokens": 64})
        first = r.json()["choices"][0]["message"]
        r = await st.chat(other, {"model": "m", "messages": [USER, first, MORE], "max_tokens": 64})
        second = r.json()["choices"][0]["message"]
        msgs = [USER, first, MORE, _inlined(second), {"role": "user", "content": "Thanks."}]
        r = await st.chat(other, {"model": "m", "messages": msgs, "max_tokens": 64})
        assert r.status_code == 200, r.text
        later = (await st.http.get(f"/sessions/{other}")).json()
    forks = [d for d in view["diagnostics"] if d["kind"] == "fork"]
    assert len(forks) == 1 and forks[0]["reason"] == "inlined_reasoning", view["diagnostics"]
    assert "<think>" in forks[0]["detail"] and "reasoning_content" in forks[0]["detail"]
    assert view["branches"][-1]["reason"] == "inlined_reasoning"
    rollbacks = [d for d in later["diagnostics"] if d["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["reason"] == "inlined_reasoning", later["diagnostics"]
    assert rollbacks[0]["checkpoint"] == 1 and later["branches"][-1]["reason"] == "rollback"


async def test_an_edited_assistant_message_is_not_blamed_on_inlined_reasoning(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        await _script(st, {"content": "Done.", "reasoning_content": "Think."}, {"content": "Ok."})
        sid = await st.session()
        r = await st.chat(sid, {"model": "m", "messages": [USER], "max_tokens": 64})
        edited = {"role": "assistant", "content": "<think>\nThink.\n</think>\n\nSomething else."}
        r = await st.chat(sid, {"model": "m", "messages": [USER, edited, MORE], "max_tokens": 64})
        assert r.status_code == 200, r.text
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert len(view["branches"]) == 2 and view["branches"][-1]["reason"] != "inlined_reasoning"  # it forked
    assert not [d for d in view["diagnostics"] if d.get("reason") == "inlined_reasoning"]
