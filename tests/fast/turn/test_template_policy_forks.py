"""Under the `template` history policy a template that rewrites history on every tool
step (the real Qwen3 template with thinking off: the prefilled empty think block of the
last assistant message is dropped once a tool result follows) forks on every tool turn,
as the policy's contract demands; each fork shares everything before the rewrite with
its parent, so the session's stored tokens grow linearly with the turns, not with the
square of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from session_server.ops.demo import TOOLS
from tests.fast.real_tokenizers import real_tokenizer_dir

from ..stack import live_stack

USER = {"role": "user", "content": "Read every file and fix the failing test."}
TURNS = 8
PER_TURN = 8  # template glue a fork stores again per step (the dropped think block is 4)


async def _script(st: Any, *turns: dict[str, Any]) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{st.engines[0]}/sim/script", json={"turns": list(turns)})
        assert r.status_code == 200, r.text


def _line(traj: dict[str, Any], branch_id: int, key: str = "token_ids") -> list[int]:
    """A branch's whole line (`key`: token_ids or loss_mask): its ancestors' parts up to
    each fork point, then its own."""
    by_id = {b["id"]: b for b in traj["branches"]}
    chain = []
    b: dict[str, Any] | None = by_id[branch_id]
    while b is not None:
        chain.append(b)
        b = by_id.get(b["parent_id"]) if b["parent_id"] is not None else None
    out: list[int] = []
    for b in reversed(chain):
        out = out[: b["fork_index"]] + b[key]
    return out


@pytest.fixture(scope="module")
def qwen3_real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_tokenizer_dir("qwen3-real", tmp_path_factory.mktemp("qwen3-real"))


async def test_qwen3_thinking_off_tool_loop_forks_share_their_prefix(qwen3_real: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen3_real))
    kw = {"enable_thinking": False}
    calls = [{"content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": f"src/f{i}.py"}}]}
             for i in range(TURNS)]
    async with live_stack(qwen3_real) as st:
        await _script(st, *calls)
        sid = await st.session(history_policy="template", chat_template_kwargs=kw)
        msgs: list[dict[str, Any]] = [USER]
        sent: list[list[dict[str, Any]]] = []
        for i in range(TURNS):
            sent.append(list(msgs))
            r = await st.chat(sid, {"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 200})
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]["message"]
            assert reply["tool_calls"], (i, reply)
            msgs += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                             "content": f"def f{i}():\n    return {i}\n"}]
        view = (await st.http.get(f"/sessions/{sid}")).json()
        traj = await st.trajectory(sid)
    # the template rewrites every tool step: one branch per step after the first (the root
    # holds turn 0), as the policy's contract says
    assert len(view["branches"]) == TURNS, view["branches"]
    assert [b["turns"] for b in view["branches"]][0] == 1
    # every branch is the template's own full render of the conversation its turn was
    # asked with, token for token, then what it sampled
    for i, b in enumerate(traj["branches"]):
        turn = b["turns"][-1]
        asked = [{**m, "content": m.get("content") or ""} for m in sent[i]]  # the template reads content
        full = tok.apply_chat_template(asked, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kw)
        assert _line(traj, b["id"])[: turn["output_start"]] == tok.encode(full, add_special_tokens=False), i
    # stored once: linear in the turns, not the sum of every branch's length. A fork stores
    # again only what changed: the previous turn's sampled tokens (now prompt, mask 0 on the
    # new branch) and a few tokens of template glue around them
    last = traj["branches"][-1]
    line = _line(traj, last["id"])
    unique = sum(len(b["token_ids"]) for b in traj["branches"])
    total = sum(len(_line(traj, b["id"])) for b in traj["branches"])
    sampled = sum(t["output_end"] - t["output_start"] for b in traj["branches"] for t in b["turns"])
    assert unique <= len(line) + sampled + PER_TURN * TURNS, (unique, len(line), sampled, total)
    assert total > 2 * unique  # the branches' lines would store the context again and again
    assert view["stored_tokens"] == unique
    # a fork shares its parent's tokens up to the think block the re-render drops, inside
    # its own first turn's prompt
    for b in traj["branches"][1:]:
        assert b["fork_checkpoint"] == 0 and b["fork_index"] > b["turns"][0]["prompt_start"], b["fork_index"]
    # on the last branch every earlier sampled token is prompt (mask 0); every earlier
    # branch keeps what its model sampled (mask 1)
    turn = last["turns"][-1]
    assert sum(_line(traj, last["id"], "loss_mask")) == turn["output_end"] - turn["output_start"]
    for b in traj["branches"]:
        mask = _line(traj, b["id"], "loss_mask")
        assert all(mask[t["output_start"]: t["output_end"]] == [1] * (t["output_end"] - t["output_start"])
                   for t in b["turns"])


async def test_a_fork_whose_turn_cannot_be_committed_leaves_no_branch_behind(
    qwen3_real: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork sharing its parent's next prompt holds that prompt head until its turn is
    committed; a commit that fails must not leave the head in the tree (an append to the
    branch would continue after it)."""
    from trajectory.errors import InvariantError
    from trajectory.linear import LinearTrajectory

    real = LinearTrajectory.commit_turn

    def refuse_on_head(self: LinearTrajectory, *args: Any, **kwargs: Any) -> Any:
        if self.prompt_head:
            raise InvariantError("refused by the test")
        return real(self, *args, **kwargs)

    calls = [{"content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": f"f{i}.py"}}]}
             for i in range(3)]
    async with live_stack(qwen3_real) as st:
        await _script(st, *calls)
        sid = await st.session(history_policy="template", chat_template_kwargs={"enable_thinking": False})
        r = await st.chat(sid, {"model": "m", "messages": [USER], "tools": TOOLS, "max_tokens": 200})
        reply = r.json()["choices"][0]["message"]
        msgs = [USER, reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "x"}]
        monkeypatch.setattr(LinearTrajectory, "commit_turn", refuse_on_head)
        r = await st.chat(sid, {"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 200})
        assert r.status_code >= 500, r.text
        failed = (await st.http.get(f"/sessions/{sid}")).json()
        monkeypatch.setattr(LinearTrajectory, "commit_turn", real)
        r = await st.chat(sid, {"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 200})
        assert r.status_code == 200, r.text
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert [b["id"] for b in failed["branches"]] == [0] and failed["active_branch"] == 0
    assert len(view["branches"]) == 2 and view["branches"][1]["fork_index"] > 0
