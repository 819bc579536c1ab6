"""TrajectoryTree: rollback and fork keep every branch and every prefix invariant."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fast.trajectory.test_linear import commit, turn_inputs
from trajectory.errors import BranchError, CheckpointError, InvariantError
from trajectory.linear import LinearTrajectory
from trajectory.tree import TrajectoryTree


def _turn(tree: TrajectoryTree, i: int) -> None:
    tree.active.trajectory.commit_turn(
        [i],
        [100 + i],
        [-0.5],
        finish_reason="stop",
        request_messages=[{"role": "user", "content": str(i)}],
        assistant_message={"role": "assistant", "content": str(i)},
    )


def test_rollback_keeps_old_branch() -> None:
    tree = TrajectoryTree()
    assert tree.active.id == 0 and tree.active.parent_id is None
    for i in range(3):
        _turn(tree, i)
    old = tree.active
    b = tree.rollback(1)
    assert (b.id, b.parent_id, b.fork_checkpoint, b.fork_index, b.reason) == (
        1,
        0,
        1,
        2,
        "rollback",
    )
    assert tree.active is b
    assert b.trajectory.ids.tolist() == [0, 100] and b.trajectory.num_turns == 1
    assert b.trajectory.messages() == old.trajectory.messages()[:2]
    assert old.trajectory.num_turns == 3  # nothing lost
    _turn(tree, 7)
    assert b.trajectory.ids.tolist() == [0, 100, 7, 107]
    assert old.trajectory.ids.tolist() == [0, 100, 1, 101, 2, 102]
    tree.check_invariants()
    assert [x.id for x in tree.branches()] == [0, 1] and tree.get(0) is old


def test_fork_is_empty_child_of_active() -> None:
    tree = TrajectoryTree()
    _turn(tree, 0)
    b = tree.fork("new_conversation")
    assert (b.parent_id, b.fork_checkpoint, b.fork_index, b.reason) == (0, 0, 0, "new_conversation")
    assert len(b.trajectory) == 0 and b.trajectory.messages() == []
    tree.check_invariants()


def test_branch_errors() -> None:
    tree = TrajectoryTree()
    _turn(tree, 0)
    with pytest.raises(BranchError):
        tree.branch_from(5, 0, "x")
    with pytest.raises(BranchError):
        tree.get(3)
    with pytest.raises(CheckpointError):
        tree.rollback(2)
    assert len(tree) == 1


def test_check_invariants_detects_a_rewritten_parent() -> None:
    tree = TrajectoryTree()
    _turn(tree, 0)
    _turn(tree, 1)
    tree.rollback(2)
    with pytest.raises(InvariantError):  # the child shares that prefix: the parent cannot drop it
        tree.get(0).trajectory.rollback(1)
    tree.check_invariants()


def test_activate() -> None:
    tree = TrajectoryTree()
    _turn(tree, 0)
    tree.fork("x")
    assert tree.activate(0).id == 0 and tree.active_id == 0
    with pytest.raises(BranchError):
        tree.activate(9)


_ops = st.lists(
    st.one_of(
        turn_inputs(),
        st.tuples(st.just("rollback"), st.floats(0.0, 1.0)),
        st.tuples(st.just("branch_from"), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
        st.tuples(st.just("fork")),
        st.tuples(st.just("activate"), st.floats(0.0, 1.0)),
    ),
    max_size=15,
)


@settings(max_examples=120, deadline=None)
@given(_ops)
def test_random_tree_operations_keep_invariants(ops: list) -> None:
    tree = TrajectoryTree()
    committed = 0  # tokens committed by any turn: each is stored once
    lines: dict[int, list[int]] = {}  # each branch's ids as built, checked after every op
    for op in ops:
        if isinstance(op, dict):
            before = len(tree.active.trajectory)
            commit(tree.active.trajectory, op)
            committed += len(tree.active.trajectory) - before
        elif op[0] == "rollback":
            n = tree.active.trajectory.num_turns
            tree.rollback(int(op[1] * n))
        elif op[0] == "branch_from":
            parent = tree.branches()[int(op[1] * (len(tree) - 1))]
            k = int(op[2] * parent.trajectory.num_turns)
            b = tree.branch_from(parent.id, k, "retry")
            assert len(b.trajectory) == b.fork_index == parent.trajectory.checkpoints[k]
        elif op[0] == "fork":
            tree.fork("rewrite")
        else:
            tree.activate(tree.branches()[int(op[1] * (len(tree) - 1))].id)
        tree.check_invariants()
        # memory is the unique tokens: a branch shares its prefix, never copies it
        assert tree.unique_tokens() == committed
        assert tree.nbytes <= 11.25 * committed
        for b in tree.branches():  # appends elsewhere never change a branch's line
            ids = b.trajectory.ids.tolist()
            if b.id in lines:
                assert ids[: len(lines[b.id])] == lines[b.id]
            lines[b.id] = ids
        seqs = [t.seq for b in tree.branches() for t in b.trajectory.turns[b.fork_checkpoint :]]
        assert sorted(seqs) == list(range(len(seqs)))  # one commit order over the tree


def test_a_tree_is_freed_without_the_cycle_collector() -> None:
    """The commit counter the branches share holds no reference back to the tree, so a
    dropped session's tree is freed by reference counting (100K sessions: no GC debt)."""
    import gc

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        tree = TrajectoryTree()
        _turn(tree, 0)
        tree.rollback(1)
        _turn(tree, 1)
        del tree
        gc.collect()
        assert not [o for o in gc.garbage if isinstance(o, TrajectoryTree | LinearTrajectory)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _prompted_turn(tree: TrajectoryTree, prompt: list[int], sampled: list[int]) -> None:
    tree.commit_turn(prompt, sampled, [-0.5] * len(sampled), finish_reason="stop",
                     request_messages=[{"role": "user", "content": str(prompt)}],
                     assistant_message={"role": "assistant", "content": str(sampled)})


def test_a_fork_into_the_next_prompt_shares_it_and_opens_its_turn_with_it() -> None:
    """A rewrite re-rendered only from its first differing token: the new branch shares
    the parent's prompt up to there (no copy), its turn's prompt starts at the checkpoint."""
    tree = TrajectoryTree()
    _prompted_turn(tree, [1, 2, 3], [10])
    _prompted_turn(tree, [4, 5, 6, 7], [11, 12])  # turn 1: prompt [4, 8), sampled [8, 10)
    parent = tree.active
    b = tree.branch_from(parent.id, 1, "template_rewrite", shared=6)
    assert (b.fork_checkpoint, b.fork_index) == (1, 6)
    assert b.trajectory.prompt_head == 2 and b.trajectory.buffer.ids.tolist() == []
    _prompted_turn(tree, [8, 9], [13])
    t = b.trajectory.turn(1)
    assert (t.prompt_start, t.output_start, t.output_end) == (4, 8, 9)
    assert b.trajectory.ids.tolist() == [1, 2, 3, 10, 4, 5, 8, 9, 13]
    assert b.trajectory.mask.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert b.trajectory.buffer.ids.tolist() == [8, 9, 13]  # only what it added
    assert tree.unique_tokens() == len(parent.trajectory) + 3
    assert parent.trajectory.ids.tolist() == [1, 2, 3, 10, 4, 5, 6, 7, 11, 12]  # kept as sampled
    tree.check_invariants()


def test_a_fork_never_shares_a_sampled_token_as_prompt() -> None:
    tree = TrajectoryTree()
    _prompted_turn(tree, [1, 2], [10, 11])
    with pytest.raises(CheckpointError, match="prompt after it"):
        tree.branch_from(0, 0, "template_rewrite", shared=3)  # token 2 was sampled
    with pytest.raises(CheckpointError, match="prompt after it"):
        tree.branch_from(0, 1, "template_rewrite", shared=5)  # past the line's end
    assert len(tree) == 1


def test_a_prompt_head_no_turn_opens_is_refused_by_the_tree_and_can_be_discarded() -> None:
    tree = TrajectoryTree()
    _prompted_turn(tree, [1, 2, 3], [10])
    b = tree.branch_from(0, 0, "template_rewrite", shared=2)
    with pytest.raises(InvariantError, match="belong to no turn"):
        tree.check_invariants()
    b.trajectory.check_invariants(allow_head=True)  # a fresh fork: a head of prompt tokens
    with pytest.raises(InvariantError, match="belong to no turn"):
        b.trajectory.check_invariants()  # at rest (an import), a head is tokens no turn holds
    tree.discard(b.id, activate=0)
    assert len(tree) == 1 and tree.active_id == 0
    tree.check_invariants()
    with pytest.raises(BranchError):
        tree.discard(0, activate=0)  # the root


def test_a_range_of_a_forked_line_is_the_slice_of_its_ids_read_from_its_segments_only() -> None:
    tree = TrajectoryTree()
    for i in range(4):
        _turn(tree, i)
    tree.rollback(3)
    for i in range(10, 13):
        _turn(tree, i)
    tree.rollback(4)  # a line over two shared segments and its own buffer
    for i in range(20, 22):
        _turn(tree, i)
    for branch in tree.branches():
        line = branch.trajectory
        n = len(line)
        assert len(line.segments()) >= 1
        for start in range(-1, n + 2):
            for end in range(-1, n + 3):
                got = line.ids_range(start, end)
                want = line.ids_until(max(0, end))[max(0, start):max(0, end)]
                assert got.tolist() == want.tolist(), (branch.id, start, end)
                assert not got.flags.writeable
    line = tree.active.trajectory
    assert len(line.segments()) == 3
    own_start = line.shared_len
    inside = line.ids_range(own_start + 1, len(line))  # inside its own buffer: a view, nothing copied
    assert np.shares_memory(inside, line.buffer.ids) and inside.tolist() == line.ids.tolist()[own_start + 1:]
