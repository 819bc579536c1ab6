"""Journal records replay into the session that was committed, bit for bit: any mix of
appends, rollbacks, forks sharing part of a prompt, weight spans, repair ids, routed
experts, lineage, rewards and notes, encoded as commit encodes them, rebuilds the same tree
(same export, same sequence numbers) and the same session fields."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec
import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.journal import Row
from session_server.journal_records import (
    CREATE,
    REWARD,
    TURN,
    create_body,
    replay_rows,
    reward_body,
    turn_body,
)
from session_server.sessions import MAX_DIAGNOSTICS, SAMPLING_POLICIES, Session, SessionConfig
from trajectory import export
from trajectory.codec.base import HistoryPolicy
from trajectory.lineage import KINDS, Lineage
from trajectory.support import SupportCSR
from trajectory.tree import ROLLBACK_REASON

ROUTED = (2, 3)  # (layers, topk) of the routed experts rows


@st.composite
def _steps(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(1, 8))):
        out.append({
            "move": draw(st.sampled_from(["append", "append", "rollback", "fork"])),
            "where": draw(st.floats(0, 1)),
            "share": draw(st.floats(0, 1)),
            "prompt": draw(st.lists(st.integers(0, 150_000), min_size=1, max_size=6)),
            "out": draw(st.lists(st.integers(0, 150_000), min_size=0, max_size=6)),
            "lp": draw(st.floats(-30, 0, width=32)),
            "repair": draw(st.booleans()),
            "spans": draw(st.booleans()),
            "version": draw(st.one_of(st.none(), st.integers(0, 9), st.text(max_size=3), st.floats(0, 1))),
            "routed": draw(st.booleans()),
            "lineage": draw(st.one_of(st.none(), st.builds(
                Lineage, agent=st.sampled_from(["main", "a25eedc37e4c0255f", "/root/worker"]),
                kind=st.sampled_from(KINDS), thread=st.one_of(st.none(), st.text(max_size=8)),
                parent=st.one_of(st.none(), st.text(max_size=8)),
                source=st.sampled_from(["x-tito-agent", "x-claude-code-agent-id", "prompt_cache_key"])))),
        })
    return out


def _commit(s: Session, step: dict[str, Any], rows: list[Row], routed_on: bool) -> None:
    """One turn as commit.py makes it: the branch change, the turn, its record."""
    tree = s.tree
    branch = tree.active
    traj = branch.trajectory
    move = step["move"] if traj.num_turns else "first"
    checkpoint, shared, reason = 0, None, None
    if move == "rollback":
        checkpoint = int(step["where"] * traj.num_turns)
        tree.branch_from(branch.id, checkpoint, ROLLBACK_REASON)
    elif move == "fork":
        checkpoint = int(step["where"] * traj.num_turns)
        at = traj.checkpoints[checkpoint]
        limit = traj.turn(checkpoint).output_start if checkpoint < traj.num_turns else at
        shared = at + int(step["share"] * (limit - at))
        reason = "template_rewrite"  # a fork sharing part of a prompt: what the template policy writes
        tree.branch_from(branch.id, checkpoint, reason, shared=shared)
    else:
        tree.activate(branch.id)
    new = tree.active
    tools = [{"type": "function", "function": {"name": f"t{new.id}"}}]
    if move in ("first", "rollback", "fork"):
        s.tools_by_branch[new.id] = tools
    ids = np.array(step["out"], dtype=np.int32)
    lps = np.full(len(ids), step["lp"], dtype=np.float32)
    spans = [(0, len(ids), step["version"])] if step["spans"] and len(ids) else None
    repair = [151645] if step["repair"] else []
    rows_needed = len(new.trajectory) + len(step["prompt"]) + len(ids) - 1 - new.trajectory.routed_start()
    routed = (np.arange(max(0, rows_needed) * 6, dtype=np.int32).reshape(-1, *ROUTED) % 64
              if routed_on else None)
    seq = tree.next_seq
    messages = [{"role": "user", "content": f"q{seq}", "n": seq, "x": 0.1 * seq}]
    answer = {"role": "assistant", "content": f"a{seq}", "tool_calls": []}
    extra = {"request_id": f"r{seq}", "parse_status": "ok", "history_rewrite": {"at": seq},
             "sampling": {"policy": "pinned", "engine": {"temperature": 1.0, "seed": 2**31 - 1 - seq, "max_tokens": 64},
                          "client": {"temperature": 0.0, "top_p": 0.5, "seed": 2**63 - 1, "max_tokens": 32000},
                          "overridden": ["temperature", "top_p", "seed"], "seeds": [seq, 2**31 - 1]},
             "segments": [{"start": 0, "end": seq, "ended": "abort", "request_id": f"r{seq}", "engine": "e0"},
                          {"start": seq, "end": seq + 3, "ended": "abort", "request_id": f"s{seq}", "engine": "e0",
                           "dropped": 2},
                          {"start": seq + 3, "end": seq + 9, "ended": "stop", "request_id": f"t{seq}", "engine": "e0"}]}
    record = new.trajectory.commit_turn(
        step["prompt"], ids, lps, finish_reason="stop", weight_spans=spans,
        weight_version=None if spans else step["version"], repair_ids=repair, request_messages=messages,
        assistant_message=answer, engine="e0", cached_tokens=seq, extra=extra, routed_experts=routed,
        lineage=step["lineage"])
    note = {"kind": "fork", "at": time.time(), "turn": record.index}
    s.diagnostics.append(note)
    s.control_totals.aborts += 1
    body = turn_body(op=move, branch_id=branch.id, checkpoint=checkpoint, reason=reason, shared=shared,
                     tools=tools if move in ("first", "rollback", "fork") else None, seq=record.seq,
                     prompt_ids=step["prompt"], ids=ids, logprobs=lps, repair=repair, finish="stop", spans=spans,
                     version=step["version"], request_messages=messages, assistant_message=answer, engine="e0",
                     cached=seq, extra=extra, routed=routed, answered=None,
                     control=[1, 0, 0.0, 0, 0, 0], notes=[note], lineage=step["lineage"])
    rows.append(Row(len(rows) + 1, s.id, TURN, time.time(), body))


@settings(max_examples=60, deadline=None)
@given(steps=_steps(), routed_on=st.booleans(), policy=st.sampled_from(SAMPLING_POLICIES),
       seed=st.none() | st.integers(0, 2**63 - 1))
def test_replayed_records_rebuild_the_committed_session(steps: list[dict[str, Any]], routed_on: bool, policy: str,
                                                        seed: int | None) -> None:
    config = SessionConfig(ttl_s=60.0, metadata={"task": "t", "n": 1}, sampling={"temperature": 0.5},
                           history_policy=HistoryPolicy.APPEND, routing_replay=routed_on,
                           sampling_policy=policy, seed=seed)
    s = Session("w0.abc", config, 0.0)
    rows = [Row(1, s.id, CREATE, time.time(), create_body(s))]
    for step in steps:
        _commit(s, step, rows, routed_on)
    s.reward, s.leaf_rewards, s.reward_metadata = 0.5, {1: 1.0}, {"score": 3}
    s.turn_rewards = {t.seq: -0.25 * t.seq for b in s.tree.branches() for t in b.trajectory.turns[::2]}
    rows.append(Row(len(rows) + 1, s.id, REWARD, time.time(), reward_body(s)))

    got = replay_rows(rows, time.monotonic)
    [back] = got.sessions
    assert back.id == s.id and back.token == s.token and back.config == s.config
    assert orjson.dumps(export.to_dict(back.tree)) == orjson.dumps(export.to_dict(s.tree))
    assert [t.seq for b in back.tree.branches() for t in b.trajectory.turns] == \
        [t.seq for b in s.tree.branches() for t in b.trajectory.turns]
    assert back.tree.active_id == s.tree.active_id and back.tree.next_seq == s.tree.next_seq
    assert back.tools_by_branch == s.tools_by_branch
    assert list(back.diagnostics) == list(s.diagnostics)
    assert dataclasses.asdict(back.control_totals) == dataclasses.asdict(s.control_totals)
    assert (back.reward, back.leaf_rewards, back.reward_metadata) == (s.reward, s.leaf_rewards, s.reward_metadata)
    assert back.turn_rewards == s.turn_rewards and all(type(v) is float for v in back.turn_rewards.values())
    for a, b in zip(back.tree.branches(), s.tree.branches(), strict=True):
        ra = [t.routed_experts for t in a.trajectory.turns]
        rb = [t.routed_experts for t in b.trajectory.turns]
        assert [None if r is None else (r.start, r.rows.tobytes()) for r in ra] == \
            [None if r is None else (r.start, r.rows.tobytes()) for r in rb]
    assert got.turns == len(rows) - 2
    # which agent and thread asked for each turn comes back with it
    assert [t.lineage for b in back.tree.branches() for t in b.trajectory.turns] == \
        [t.lineage for b in s.tree.branches() for t in b.trajectory.turns]
    assert (back.config.sampling_policy, back.config.seed) == (policy, seed)
    assert [t.extra["sampling"] for b in back.tree.branches() for t in b.trajectory.turns] == \
        [t.extra["sampling"] for b in s.tree.branches() for t in b.trajectory.turns]
    # where each abort cut a turn and its resubmission went on (the viewer's abort markers)
    assert [t.extra["segments"] for b in back.tree.branches() for t in b.trajectory.turns] == \
        [t.extra["segments"] for b in s.tree.branches() for t in b.trajectory.turns]


def test_a_recovered_session_keeps_its_count_of_dropped_diagnostics() -> None:
    s = Session("w0.abc", SessionConfig(ttl_s=60.0), 0.0)
    rows = [Row(1, s.id, CREATE, time.time(), create_body(s))]
    for k in range(MAX_DIAGNOSTICS + 10):  # a long session: every turn repaired, one note each
        op = "first" if k == 0 else "append"
        ids, lps = np.array([7, 8], dtype=np.int32), np.zeros(2, dtype=np.float32)
        record = s.tree.active.trajectory.commit_turn([k + 1], ids, lps, finish_reason="stop", repair_ids=[9],
                                                     request_messages=[], assistant_message={}, engine="e0")
        before = len(s.diagnostics)
        s.note("repair", turn=record.index, tokens=1, finish_reason="stop")  # as commit.py notes it
        notes = list(s.diagnostics)[-1:] if len(s.diagnostics) >= before else []
        rows.append(Row(len(rows) + 1, s.id, TURN, time.time(), turn_body(
            op=op, branch_id=0, checkpoint=0, reason=None, shared=None, tools=None, seq=record.seq,
            prompt_ids=[k + 1], ids=ids, logprobs=lps, repair=[9], finish="stop", spans=None, version=None,
            request_messages=[], assistant_message={}, engine="e0", cached=0, extra={}, routed=None,
            answered=None, control=None, notes=notes)))
    [back] = replay_rows(rows, time.monotonic).sessions
    assert s.diagnostics_dropped == 10
    assert list(back.diagnostics) == list(s.diagnostics)
    assert back.diagnostics_dropped == s.diagnostics_dropped  # the session view's diagnostics_dropped


def test_a_reward_record_from_before_per_turn_rewards_replays_with_none() -> None:
    s = Session("w0.abc", SessionConfig(ttl_s=60.0), 0.0)
    old = msgspec.msgpack.encode({"reward": 1.0, "leaf_rewards": [], "reward_metadata": {}, "wall": time.time()})
    rows = [Row(1, s.id, CREATE, time.time(), create_body(s)), Row(2, s.id, REWARD, time.time(), old)]
    [back] = replay_rows(rows, time.monotonic).sessions
    assert back.reward == 1.0 and back.turn_rewards == {}


@settings(max_examples=30, deadline=None)
@given(turns=st.lists(st.lists(st.lists(st.integers(0, 151_000), min_size=1, max_size=8), min_size=1, max_size=6),
                      min_size=1, max_size=4))
def test_replayed_turns_keep_their_sampling_support_and_the_session_its_k(turns: list[list[list[int]]]) -> None:
    s = Session("w0.sup", SessionConfig(ttl_s=60.0, sampling={"top_k": 8, "temperature": 1.0}, sampling_support=8),
                0.0)
    rows = [Row(1, s.id, CREATE, time.time(), create_body(s))]
    for k, support in enumerate(turns):
        ids = np.array([r[0] for r in support], dtype=np.int32)
        lps = np.full(len(ids), -0.25, dtype=np.float32)
        csr = SupportCSR.from_lists(support)
        record = s.tree.active.trajectory.commit_turn([k + 1], ids, lps, finish_reason="stop", engine="e0",
                                                     sampling_support=csr)
        rows.append(Row(len(rows) + 1, s.id, TURN, time.time(), turn_body(
            op="first" if k == 0 else "append", branch_id=0, checkpoint=0, reason=None, shared=None, tools=None,
            seq=record.seq, prompt_ids=[k + 1], ids=ids, logprobs=lps, repair=[], finish="stop", spans=None,
            version=None, request_messages=[], assistant_message={}, engine="e0", cached=0, extra={}, routed=None,
            answered=None, control=None, notes=[], support=csr)))
    [back] = replay_rows(rows, time.monotonic).sessions
    assert back.config == s.config and back.config.sampling_support == 8
    got = [t.sampling_support for t in back.tree.active.trajectory.turns]
    assert [g.to_lists() if g is not None else None for g in got] == turns


def test_forks_journaled_under_the_old_single_word_replay_with_the_word_each_gets_now() -> None:
    """Before each meaning had its word, every fork without a known cause (a new
    conversation, a resent turn 0, an edited first turn, a title request) and a template's
    rewrite were journaled as `history_rewrite`: such a journal still replays, each branch
    named as prepare names it now (`shared` set: the template's fork)."""
    s = Session("w0.old", SessionConfig(ttl_s=60.0), 0.0)
    rows = [Row(1, s.id, CREATE, time.time(), create_body(s))]
    first = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "fix it"}]
    title = Lineage(agent="title", kind="side", source="x-tito-agent")
    forks = [  # (op, the request's messages, shared, lineage)
        ("first", first, None, None),
        ("fork", first, None, None),  # turn 0 again
        ("fork", [{"role": "user", "content": "something else"}], None, None),
        ("fork", [first[0], {"role": "user", "content": "fix the other one"}], None, None),
        ("fork", [{"role": "system", "content": "Write a title."}, first[1]], None, title),
        ("fork", first, 1, None),  # a template's rewrite: shares a token past checkpoint 0
    ]
    answer = {"role": "assistant", "content": "done"}
    for op, msgs, shared, lineage in forks:
        if op == "fork":
            s.tree.branch_from(0, 0, "history_rewrite", shared=shared)
        prompt = [1, 2, 3] if shared is None else [2, 3]
        ids, lps = np.array([4, 5], dtype=np.int32), np.zeros(2, dtype=np.float32)
        record = s.tree.active.trajectory.commit_turn(prompt, ids, lps, finish_reason="stop", request_messages=msgs,
                                                     assistant_message=answer, engine="e0", lineage=lineage)
        rows.append(Row(len(rows) + 1, s.id, TURN, time.time(), turn_body(
            op=op, branch_id=0, checkpoint=0, reason="history_rewrite" if op == "fork" else None, shared=shared,
            tools=None, seq=record.seq, prompt_ids=prompt, ids=ids, logprobs=lps, repair=[], finish="stop",
            spans=None, version=None, request_messages=msgs, assistant_message=answer, engine="e0", cached=0,
            extra={}, routed=None, answered=None, control=None, notes=[], lineage=lineage)))
    [back] = replay_rows(rows, time.monotonic).sessions
    assert [b.reason for b in back.tree.branches()] == [
        "root", "first_turn_resent", "new_conversation", "history_edited", "side_request", "template_rewrite"]
    assert [len(b.trajectory) for b in back.tree.branches()] == [len(b.trajectory) for b in s.tree.branches()]
