"""attach: a request continues the deepest node of the whole tree whose messages prefix it.

An agent that renames tool-call ids extends its line (the renames are
reported), and a main agent that resumes after a sub-agent extends the main line.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.history import Attachment, attach
from trajectory.sent_forms import SentForms
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


def _forgetting(tree: TrajectoryTree) -> None:
    """Every line as if no sent form had ever matched (the comparison message by message)."""
    for b in tree.branches():
        b.trajectory.sent_forms = SentForms()


def _variant(message: dict[str, Any], how: int) -> dict[str, Any]:
    """A form of `message` a client may send back: as is, keys reordered, empty content
    as None, a name of another JSON type (`1` and `true` are different messages), or the
    text edited (a different message)."""
    if how == 1:
        return dict(reversed(list(message.items())))
    if how == 2 and not message.get("content"):
        return {**message, "content": None if message.get("content") == "" else ""}
    if how == 3:
        return {**message, "name": 1}
    if how == 4:
        return {**message, "name": True}
    if how == 5:
        return {**message, "content": f"{message.get('content')} (edited)"}
    return dict(message)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(0, 5), min_size=8, max_size=8),
                          st.integers(0, 3)), min_size=1, max_size=10))
def test_known_sent_forms_never_change_where_a_request_attaches(
        steps: list[tuple[int, list[int], int]]) -> None:
    """Whatever forms the re-sent messages take (reordered keys, None for "", a `1` where
    `true` was sent, edits) and however far back a request cuts its history, the digests
    kept of forms that matched before give the very attachment a tree that knows none of
    them computes, message by message."""
    tree = TrajectoryTree()
    convs: dict[int, list[dict[str, Any]]] = {}
    for agent, hows, cut in steps:
        base = convs.setdefault(agent, [{"role": "system", "content": f"agent {agent}"},
                                        {"role": "user", "content": "go"}])
        kept = base[: max(2, len(base) - 2 * cut)]
        request = [_variant(m, hows[i % len(hows)]) for i, m in enumerate(kept)]
        request.append({"role": "user", "content": f"step {len(request)}"})
        plan = attach(tree, request)
        remembered = [b.trajectory.sent_forms for b in tree.branches()]
        _forgetting(tree)
        assert attach(tree, request) == plan
        for b, forms in zip(tree.branches(), remembered, strict=True):
            b.trajectory.sent_forms = forms
        n = sum(1 for m in request if m["role"] == "assistant")
        commit(tree, plan, call(n, f"{agent}_{n}"))
        convs[agent] = [*request, call(n, f"sdk_{agent}_{n}"), tool(f"sdk_{agent}_{n}")]


def test_a_known_form_matches_only_at_its_own_position() -> None:
    """A message re-sent where another, identical-looking one stood (the tool result
    repeated in place of the user's next message) is a different history: the request
    rolls back to the last turn it still matches."""
    tree = TrajectoryTree()
    request = [SYS, {"role": "user", "content": "go"}]
    for i in range(3):
        commit(tree, attach(tree, request), call(i, f"c{i}"))
        request = [*request, call(i, f"c{i}"), tool(f"c{i}")]
    assert attach(tree, request).kind == "append"  # every form seen and kept
    moved = [*request[:4], request[3], *request[5:]]  # turn 1's tool result at message 4
    plan = attach(tree, moved)
    assert (plan.kind, plan.checkpoint) == ("rollback", 1)
