"""Each reason a request opens a branch from the root has its own word in the session
view, and the view counts the session's turns over every branch beside the active
line's: a new conversation, turn 0 resent, a first turn edited, a side request (by its
lineage); `history_rewrite` is only the per-turn diagnostic."""

from __future__ import annotations

from pathlib import Path

from ..stack import live_stack

SYS = {"role": "system", "content": "You fix bugs."}
USER = {"role": "user", "content": "Fix the failing test."}


async def test_each_root_fork_names_what_the_request_is_and_turns_total_counts_every_branch(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()

        async def turn(messages: list[dict[str, str]], **kw: object) -> None:
            r = await st.chat(sid, {"model": "m", "messages": messages, "max_tokens": 16}, **kw)
            assert r.status_code == 200, r.text

        await turn([SYS, USER])
        await turn([SYS, USER])  # turn 0 again (no idempotency key: not a replay)
        await turn([{"role": "user", "content": "What is 2 + 2?"}])
        await turn([SYS, {"role": "user", "content": "Fix the other test."}])
        await turn([{"role": "system", "content": "Write a 5-word title."}, USER],
                   headers={"x-tito-agent": "title", "x-tito-agent-kind": "side"})
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert [b["reason"] for b in view["branches"]] == [
        "root", "first_turn_resent", "new_conversation", "history_edited", "side_request"], view["branches"]
    # the active line holds one turn; the session committed five, one per branch
    assert (view["turns"], view["turns_total"]) == (1, 5), view
    assert not [d for d in view["diagnostics"] if d.get("reason") == "history_rewrite"]
