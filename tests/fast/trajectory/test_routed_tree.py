"""Routing replay (R3) in the tree: routed-experts rows under rollbacks, forks (rewrites) and export.

A branch shares its parent's turns before its fork point, rows included, so its
line's rows before the fork are the parent's; its next turn asks from where the
kept turns' rows end (`routed_start`); a fork (a rewritten history, re-rendered
from scratch) asks from 0. `commit_turn` refuses rows that do not continue the
branch exactly, and export -> import keeps every branch's rows."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from trajectory import from_dict, from_npz_bytes
from trajectory.errors import InvariantError
from trajectory.export import to_dict, to_npz_bytes
from trajectory.export_stream import to_json_bytes
from trajectory.linear import LinearTrajectory
from trajectory.routed import line_rows
from trajectory.samples import build_samples
from trajectory.tree import TrajectoryTree

LAYERS, TOPK, EXPERTS = 3, 2, 40


def _engine_rows(line: np.ndarray | list[int], start: int, end: int) -> np.ndarray:
    """A deterministic 'engine': position p's experts from (token at p, p, layer, slot)."""
    ids = np.asarray(line, dtype=np.int64)[start:end, None, None]
    pos = np.arange(start, end)[:, None, None]
    lk = np.arange(LAYERS)[None, :, None] * 7 + np.arange(TOPK)[None, None, :] * 13
    return ((ids * 31 + pos * 5 + lk) % EXPERTS).astype(np.uint8)


def _turn(traj: LinearTrajectory, i: int, *, rows: bool = True, skew: int = 0) -> None:
    """Commit turn `i` (3 prompt + 4 sampled + 1 repair token) with the engine's rows for
    ``[routed_start, output_end - 1)``; `skew` rows more (or fewer) to lie."""
    prompt, sampled, repair = [10 + i, 11 + i, 12 + i], [50 + i, 51 + i, 52 + i, 53 + i], [99]
    line = [*traj.ids.tolist(), *prompt, *sampled]
    start = traj.routed_start()
    routed = _engine_rows(line + [0] * max(0, skew), start, len(line) - 1 + skew) if rows else None
    traj.commit_turn(prompt, sampled, [-0.5] * 4, finish_reason="stop", repair_ids=repair,
                     request_messages=[{"role": "user", "content": str(i)}],
                     assistant_message={"role": "assistant", "content": str(i)}, routed_experts=routed)


def _expected_line_rows(traj: LinearTrajectory) -> np.ndarray:
    """What the trainer must get: the engine's rows for every forwarded position, 0 after
    the last sampled token (each turn's repair token was never forwarded, so the engine
    saw it only as part of the next turn's context; the line ids are what it saw)."""
    ids = traj.ids.tolist()
    out = _engine_rows(ids, 0, len(ids) - 1)
    last = traj.turns[-1].output_end
    out[last - 1 :] = 0
    return out


def _tree_with_branches() -> TrajectoryTree:
    tree = TrajectoryTree()
    for i in range(3):
        _turn(tree.active.trajectory, i)
    tree.rollback(1)  # branch 1: turn 0 of branch 0, then its own
    _turn(tree.active.trajectory, 7)
    tree.fork("new_conversation")  # branch 2: re-rendered from scratch
    _turn(tree.active.trajectory, 8)
    _turn(tree.active.trajectory, 9)
    return tree


def test_a_rollback_branch_shares_the_parents_rows_and_asks_from_the_fork_point() -> None:
    tree = TrajectoryTree()
    for i in range(3):
        _turn(tree.active.trajectory, i)
    parent = tree.active.trajectory
    parent_rows = line_rows(parent.turns, len(parent))
    b = tree.rollback(1)
    child = b.trajectory
    # the kept turn's rows are the parent's own object; the next turn asks from its end
    assert child.turns[0].routed_experts is parent.turns[0].routed_experts
    assert child.routed_start() == parent.turns[0].output_end - 1
    _turn(child, 7)
    assert child.turns[1].routed_experts.start == parent.turns[0].output_end - 1
    rows = line_rows(child.turns, len(child))
    assert rows is not None and rows.shape == (len(child) - 1, LAYERS, TOPK)
    np.testing.assert_array_equal(rows, _expected_line_rows(child))
    # before the fork point the child's rows are the parent's
    fork = parent.turns[0].output_end - 1
    np.testing.assert_array_equal(rows[:fork], parent_rows[:fork])
    np.testing.assert_array_equal(line_rows(parent.turns, len(parent)), parent_rows)  # parent untouched
    tree.check_invariants()


def test_a_fork_rewrite_asks_from_zero_and_a_turn_without_rows_restarts_the_chain() -> None:
    tree = TrajectoryTree()
    _turn(tree.active.trajectory, 0)
    _turn(tree.active.trajectory, 1)
    b = tree.fork("new_conversation")
    assert b.trajectory.routed_start() == 0  # a rewrite re-renders the line: every position again
    _turn(b.trajectory, 5)
    assert b.trajectory.turns[0].routed_experts.start == 0
    np.testing.assert_array_equal(line_rows(b.trajectory.turns, len(b.trajectory)),
                                  _expected_line_rows(b.trajectory))
    # a turn recorded without rows (routing replay off) leaves no usable prefix...
    _turn(b.trajectory, 6, rows=False)
    assert b.trajectory.routed_start() == 0
    assert line_rows(b.trajectory.turns, len(b.trajectory)) is None
    # ...so the next turn asks for the whole line again, and the line is covered from it
    _turn(b.trajectory, 7)
    assert b.trajectory.turns[-1].routed_experts.start == 0
    np.testing.assert_array_equal(line_rows(b.trajectory.turns, len(b.trajectory)),
                                  _expected_line_rows(b.trajectory))
    tree.check_invariants()


@pytest.mark.parametrize("skew", [1, -1])
def test_commit_turn_refuses_rows_that_do_not_continue_the_branch(skew: int) -> None:
    tree = TrajectoryTree()
    _turn(tree.active.trajectory, 0)
    _turn(tree.active.trajectory, 1)
    child = tree.rollback(1).trajectory
    before = (len(child), child.num_turns, child.routed_start())
    with pytest.raises(InvariantError, match="routed experts cover"):
        _turn(child, 7, skew=skew)  # one row more / fewer than [routed_start, output_end - 1)
    assert (len(child), child.num_turns, child.routed_start()) == before  # nothing written
    # rows as if the parent's second turn were still there (they start too late)
    traj = child
    prompt, sampled = [17, 18, 19], [57, 58, 59, 60]
    line = [*traj.ids.tolist(), *prompt, *sampled]
    late = _engine_rows(line, tree.get(0).trajectory.routed_start(), len(line) - 1)
    with pytest.raises(InvariantError):
        traj.commit_turn(prompt, sampled, [-0.5] * 4, finish_reason="stop", routed_experts=late)
    # rows of another (layers, topk) than the branch's
    other = np.zeros((len(line) - 1 - traj.routed_start(), LAYERS + 1, TOPK), dtype=np.uint8)
    with pytest.raises(InvariantError, match="shape"):
        traj.commit_turn(prompt, sampled, [-0.5] * 4, finish_reason="stop", routed_experts=other)
    assert (len(child), child.num_turns) == before[:2]
    tree.check_invariants()


@pytest.mark.parametrize("fmt", ["dict", "json", "npz"])
def test_export_import_round_trip_keeps_every_branchs_rows(fmt: str) -> None:
    tree = _tree_with_branches()
    if fmt == "dict":
        back = from_dict(to_dict(tree))
    elif fmt == "json":
        back = from_dict(orjson.loads(to_json_bytes(tree)))
    else:
        back = from_npz_bytes(to_npz_bytes(tree))
    back.check_invariants()
    assert [b.id for b in back.branches()] == [b.id for b in tree.branches()]
    for b in tree.branches():
        got = back.get(b.id).trajectory
        assert [t.routed_experts is not None for t in got.turns] == [t.routed_experts is not None
                                                                     for t in b.trajectory.turns]
        for t, u in zip(b.trajectory.turns, got.turns, strict=True):
            if t.routed_experts is not None:
                assert u.routed_experts.start == t.routed_experts.start
                assert u.routed_experts.rows.dtype == t.routed_experts.rows.dtype
                np.testing.assert_array_equal(u.routed_experts.rows, t.routed_experts.rows)
        # the imported branch still shares its parent's rows before the fork point
        pb = back.get(b.id)
        if pb.parent_id is not None and pb.fork_checkpoint:
            parent = back.get(pb.parent_id).trajectory
            assert pb.trajectory.turns[0].routed_experts is parent.turns[0].routed_experts
        assert got.routed_start() == b.trajectory.routed_start()
    # every leaf's sample rows survive too, `len(token_ids) - 1` of them
    for s, s2 in zip(build_samples(tree, picker="all"), build_samples(back, picker="all"), strict=True):
        assert s.routed_experts is not None and s.routed_experts.shape[0] == len(s.token_ids) - 1
        np.testing.assert_array_equal(s.routed_experts, s2.routed_experts)
