"""Samples carry each turn's lineage (`turn_lineage`) in every format, and
`build_samples(agent=...)` selects lines by the agent that asked for their turns and
trains only that agent's turns, each exactly once."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from trajectory.errors import ExportError
from trajectory.lineage import AgentFilter, Lineage
from trajectory.sample_formats import (
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
    samples_to_json,
    samples_to_npz,
    samples_to_safetensors,
)
from trajectory.samples import Sample, build_samples
from trajectory.tree import TrajectoryTree

from .test_samples import assert_same_samples

FORMATS = ((samples_to_json, load_samples_json), (samples_to_npz, load_samples_npz),
           (samples_to_safetensors, load_samples_safetensors))
MAIN = Lineage("main", "main", "t-main", None, "x-tito-agent")
SIDE = Lineage("compact", "side", "t-main", None, "x-openai-subagent")
SUB = Lineage("explorer", "subagent", "t-sub", "t-main", "x-tito-agent")


def _turn(tree: TrajectoryTree, i: int, lineage: Lineage | None) -> None:
    tree.commit_turn([i], [100 + i, 200 + i], [-0.5, -0.25], finish_reason="stop", weight_version=1,
                     lineage=lineage, request_messages=[{"role": "user", "content": f"r{i}"}])


def _harness_tree() -> TrajectoryTree:
    """The main agent's two turns (branch 0); a compaction side request that sends the
    main history (branch 1, forked at the main's end: branch 0 is then no leaf); the
    main agent going on from its own end (branch 2); a sub-agent with a history of its
    own (branch 3, from the root); one turn no client labelled (branch 4)."""
    t = TrajectoryTree()
    _turn(t, 0, MAIN)
    _turn(t, 1, MAIN)
    t.branch_from(0, 2, "new_conversation")
    _turn(t, 2, SIDE)
    t.branch_from(0, 2, "rollback")
    _turn(t, 3, MAIN)
    t.branch_from(0, 0, "new_conversation")
    _turn(t, 4, SUB)
    _turn(t, 5, SUB)
    t.branch_from(0, 0, "new_conversation")
    _turn(t, 6, None)
    return t


def _trained(samples: list[Sample]) -> list[int]:
    """The prompt id of every turn some sample trains (each turn's prompt is its number)."""
    out = []
    for s in samples:
        for (p, o, e) in s.turn_boundaries:
            if s.loss_mask[o:e].any():
                assert s.loss_mask[o:e].all()
                out.append(int(s.token_ids[p]))
    return sorted(out)


def test_samples_carry_each_turns_lineage_in_every_format() -> None:
    samples = build_samples(_harness_tree(), picker="all")
    assert [s.turn_lineage for s in samples] == [
        [MAIN.to_dict(), MAIN.to_dict(), SIDE.to_dict()], [MAIN.to_dict()] * 3,
        [SUB.to_dict(), SUB.to_dict()], [None]]
    for dump, load in FORMATS:
        back = load(dump(samples))
        assert_same_samples(back, samples)
        assert [s.turn_lineage for s in back] == [s.turn_lineage for s in samples]


def test_a_payload_written_before_lineage_loads_with_none_per_turn() -> None:
    samples = build_samples(_harness_tree(), picker="all")
    old = orjson.loads(samples_to_json(samples))
    for d in old["samples"]:
        del d["turn_lineage"]
    back = load_samples_json(old)
    assert [s.turn_lineage for s in back] == [[None] * len(s.turn_boundaries) for s in samples]


@pytest.mark.parametrize(("bad", "message"), [
    ([{"agent": "main", "kind": "boss"}, None, None], "turn_lineage\\[0\\]"),
    ([None, None], "turn_lineage must be a list of 3"),
    ([{**MAIN.to_dict(), "extra": 1}, None, None], "turn_lineage\\[0\\] has fields"),
    ("main", "turn_lineage must be a list of 3"),
])
def test_a_loader_refuses_a_malformed_turn_lineage(bad: Any, message: str) -> None:
    good = orjson.loads(samples_to_json(build_samples(_harness_tree(), picker="all")[:1]))
    good["samples"][0]["turn_lineage"] = bad
    with pytest.raises(ExportError, match=message):
        load_samples_json(good)
    (s,) = load_samples_json(samples_to_json(build_samples(_harness_tree(), picker="all")[:1]))
    s.turn_lineage = bad
    for dump, load in FORMATS[1:]:
        with pytest.raises(ExportError, match=message):
            load(dump([s]))


def test_an_agent_filter_trains_only_that_agents_turns_each_exactly_once() -> None:
    t = _harness_tree()
    main = build_samples(t, picker="all", agent=AgentFilter(kind="main"))
    # the side line is cut after the main's turns and trains them (it comes first);
    # the main's own line then trains only its new turn
    assert [s.path for s in main] == [[0, 1], [0, 2]]
    assert _trained(main) == [0, 1, 3]
    assert main[0].turn_lineage == [MAIN.to_dict()] * 2 and main[0].reason is not None
    assert "agent filter" in main[0].reason and main[0].status == "completed"
    side = build_samples(t, picker="all", agent=AgentFilter(kind="side"))
    # the main's turns stay in the side line as context, trained nowhere here
    assert [s.path for s in side] == [[0, 1]] and _trained(side) == [2]
    (s,) = side
    assert len(s.turn_boundaries) == 3 and s.reason is None
    assert not s.logprobs[: s.turn_boundaries[2][1]].any()
    sub = build_samples(t, picker="all", agent=AgentFilter(agent="explorer"))
    assert [s.path for s in sub] == [[0, 3]] and _trained(sub) == [4, 5]
    assert build_samples(t, picker="all", agent=AgentFilter(agent="explorer", kind="main")) == []
    assert build_samples(t, picker="all", agent=AgentFilter(agent="nobody")) == []
    # no filter: every line, every turn trained once, the unlabelled one too
    assert _trained(build_samples(t, picker="all")) == [0, 1, 2, 3, 4, 5, 6]
    assert _trained(build_samples(t, picker="all", agent=AgentFilter())) == [0, 1, 2, 3, 4, 5, 6]


def test_a_line_cut_to_turns_an_earlier_sample_trains_is_dropped() -> None:
    t = TrajectoryTree()
    _turn(t, 0, MAIN)
    _turn(t, 1, MAIN)
    t.branch_from(0, 1, "rollback")  # a side request sent after the main's first turn
    _turn(t, 2, SIDE)
    samples = build_samples(t, picker="all", agent=AgentFilter(kind="main"))
    assert [s.path for s in samples] == [[0]] and _trained(samples) == [0, 1]


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="agent_kind must be one of main, subagent, side"):
        AgentFilter(kind="boss")


def test_a_line_whose_first_selected_turn_is_past_max_seq_len_still_comes_back_truncated() -> None:
    """Without a filter a line whose first turn already ends past `max_seq_len` comes back
    empty with status "truncated" and a reason (trajectory/samples.py "Truncation"), so a
    trainer sees what it lost. With `agent=` the same line must not vanish silently: its
    first turn is the selected agent's, no earlier sample trains it."""
    t = TrajectoryTree()
    t.commit_turn([1, 2, 3, 4], [100, 101, 102], [-0.5] * 3, finish_reason="stop", lineage=MAIN)
    [plain] = build_samples(t, max_seq_len=3)
    assert plain.status == "truncated" and len(plain) == 0 and plain.reason
    got = build_samples(t, max_seq_len=3, agent=AgentFilter("main"))
    assert [(s.status, len(s), bool(s.reason)) for s in got] == [("truncated", 0, True)]
