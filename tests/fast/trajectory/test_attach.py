"""attach: a request continues the deepest node of the whole tree whose messages prefix it.

An agent that renames tool-call ids extends its line (the renames are
reported), and a main agent that resumes after a sub-agent extends the main line.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.history import Attachment, attach
from trajectory.tree import TrajectoryTree

SYS = {"role": "system", "content": "main agent"}
SUB = {"role": "system", "content": "sub-agent"}


def call(i: int, cid: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": cid, "type": "function",
                            "function": {"name": "run", "arguments": f'{{"step": {i}}}'}}]}


def tool(cid: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": "ok"}


def commit(tree: TrajectoryTree, plan: Attachment, reply: dict[str, Any]) -> None:
    """What the server's commit does with an attachment (prepare decided, commit applies)."""
    if plan.kind in ("first", "append"):
        tree.activate(plan.branch_id)
    elif plan.kind == "rollback":
        tree.branch_from(plan.branch_id, plan.checkpoint, "rollback")
    else:
        tree.branch_from(plan.branch_id, 0, "new_conversation")
    tree.commit_turn([1, 2], [3], [-0.5], finish_reason="tool_calls",
                     request_messages=plan.new_messages, assistant_message=reply)


def test_renamed_tool_call_ids_extend_the_line_and_are_reported() -> None:
    tree = TrajectoryTree()
    request = [SYS, {"role": "user", "content": "go"}]
    for i in range(4):
        plan = attach(tree, request)
        assert plan.kind == ("first" if i == 0 else "append") and plan.branch_id == 0
        if i:
            assert plan.renames == {f"sdk_{i - 1}": f"call_{i - 1}"}
        ours = call(i, f"call_{i}")
        commit(tree, plan, ours)
        # the SDK re-sends our call under its own id, and answers that id
        request = [*request, call(i, f"sdk_{i}"), tool(f"sdk_{i}")]
    assert len(tree) == 1  # no fork, no rollback: one line


def test_a_changed_call_is_not_a_rename() -> None:
    tree = TrajectoryTree()
    request = [SYS, {"role": "user", "content": "go"}]
    commit(tree, attach(tree, request), call(0, "call_0"))
    edited = [*request, call(1, "sdk_0"), tool("sdk_0")]  # other arguments than the model's
    plan = attach(tree, edited)
    assert plan.kind == "fork" and plan.new_messages == edited  # nothing past the root matches


def test_a_sub_agent_interleave_resumes_the_main_line() -> None:
    tree = TrajectoryTree()
    main = [SYS, {"role": "user", "content": "fix the bug"}]
    sub = [SUB, {"role": "user", "content": "read the logs"}]
    for i in range(3):
        plan = attach(tree, main)
        assert plan.kind in ("first", "append") and plan.branch_id == 0  # always the main line
        commit(tree, plan, call(i, f"m{i}"))
        main = [*main, call(i, f"m{i}"), tool(f"m{i}")]
        plan = attach(tree, sub)  # the sub-agent: its own conversation
        assert plan.kind == ("fork" if i == 0 else "append")
        commit(tree, plan, call(i, f"s{i}"))
        assert i == 0 or plan.branch_id == 1
        sub = [*sub, call(i, f"s{i}"), tool(f"s{i}")]
    assert len(tree) == 2
    assert tree.get(0).trajectory.num_turns == 3 and tree.get(1).trajectory.num_turns == 3


def test_a_retry_inside_an_older_line_rolls_back_there() -> None:
    tree = TrajectoryTree()
    main = [SYS, {"role": "user", "content": "task"}]
    history = list(main)
    for i in range(3):
        commit(tree, attach(tree, history), call(i, f"c{i}"))
        history = [*history, call(i, f"c{i}"), tool(f"c{i}")]
    commit(tree, attach(tree, [SUB, {"role": "user", "content": "x"}]), call(9, "s"))  # sub-agent
    retry = history[:4]  # main line up to turn 0's answer and tool result: retry turn 1
    plan = attach(tree, retry)
    assert (plan.kind, plan.branch_id, plan.checkpoint) == ("rollback", 0, 1)
    assert plan.new_messages == [retry[3]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=12))
def test_interleaved_conversations_never_fork_needlessly(steps: list[tuple[int, bool]]) -> None:
    """Any interleaving of up to three agents, with or without id renames, keeps one
    line per agent: each request attaches at the end of its own agent's line."""
    tree = TrajectoryTree()
    convs: dict[int, list[dict[str, Any]]] = {}
    branch_of: dict[int, int] = {}
    for agent, rename in steps:
        request = convs.setdefault(agent, [{"role": "system", "content": f"agent {agent}"},
                                           {"role": "user", "content": "go"}])
        plan = attach(tree, request)
        if agent in branch_of:
            assert (plan.kind, plan.branch_id) == ("append", branch_of[agent])
        n = sum(1 for m in request if m["role"] == "assistant")
        ours = call(n, f"{agent}_{n}")
        commit(tree, plan, ours)
        branch_of[agent] = tree.active_id
        cid = f"sdk_{agent}_{n}" if rename else f"{agent}_{n}"
        convs[agent] = [*request, call(n, cid), tool(cid)]
    assert len(tree) == len(convs)
