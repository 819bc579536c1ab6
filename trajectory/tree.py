"""A session's branches: linked `LinearTrajectory`s created by rollback and fork.

Nothing a session committed is ever thrown away. A rollback (the agent re-sent
an earlier prefix) or a fork (the history was rewritten) starts a new *active*
branch; the old one stays in the tree for the trainer, and a later request can
go back to it (`activate`). A branch created at a checkpoint of its parent
*shares* the parent's prefix (`LinearTrajectory.fork_at`): its tokens up to the
fork point are segments of its ancestors' buffers, never a copy, so the tree
holds each token once. The fork point may lie past the checkpoint, inside the
parent's next prompt (a history rewrite shares everything before the first token
the template's re-render changes) (memory O(unique tokens), `unique_tokens`/`nbytes`). The
turn and message lists of the prefix are shared by reference (O(turns) pointers).

Every turn committed on any branch gets the tree's next sequence number
(`TurnRecord.seq`), so "which continuation is later" is known even when an
agent returns to an older branch.

Branch ids are small ints in creation order; branch 0 is the empty root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trajectory.errors import BranchError, CheckpointError, InvariantError
from trajectory.linear import LinearTrajectory
from trajectory.turn_record import TurnRecord

ROOT_REASON = "root"
ROLLBACK_REASON = "rollback"
# Why a branch left its parent: one word per meaning (a branch's `reason`; the codec
# refusals a `template` fork names, `not_append_only`, `role_mismatch`, ..., and the causes
# prepare finds, `tools_changed`, `inlined_reasoning`, are the others). A request that
# matches nothing past the root of any line starts a branch from the root as one of:
NEW_CONVERSATION = "new_conversation"  # it shares no message with any line
HISTORY_EDITED = "history_edited"  # it opens as a line does but differs inside its first turn's input
FIRST_TURN_RESENT = "first_turn_resent"  # it repeats a line's whole first-turn input (turn 0 again)
SIDE_REQUEST = "side_request"  # its lineage says a side request (a title, a summary, a compaction)
SUBAGENT = "subagent"  # its lineage says a sub-agent
# the template re-renders earlier turns and the session follows the template (a fork
# under `history_policy="template"`; under `append` the same event is the per-turn
# `history_rewrite` diagnostic and no branch)
TEMPLATE_REWRITE = "template_rewrite"
LEGACY_FORK_REASON = "history_rewrite"
"""The one word every fork without a known cause, and a template's rewrite, got before
the words above; journals written then still hold it (`journal_records` reads it back
as the word the branch gets now)."""


@dataclass(slots=True)
class Branch:
    """One branch: its trajectory and where it left its parent."""

    id: int
    parent_id: int | None  # None only for the root
    fork_checkpoint: int  # checkpoint index on the parent
    # tokens shared with the parent: the checkpoint's position, or further into the prompt
    # of the parent's next turn (a rewrite forks where the re-render first differs)
    fork_index: int
    trajectory: LinearTrajectory
    reason: str


class _Clock:
    """The tree's commit counter: each call gives the next sequence number. Settable
    (`TrajectoryTree.set_next_seq`) so a journal replay numbers turns as they were."""

    __slots__ = ("next",)

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def __call__(self) -> int:
        n = self.next
        self.next = n + 1
        return n


class TrajectoryTree:
    """All branches of one session, with one active branch that turns append to."""

    __slots__ = ("_branches", "_active", "_seq", "metadata")

    def __init__(self) -> None:
        # the commit counter is shared with the branches' trajectories; it is its own
        # object (not a method of the tree) so no reference cycle keeps a tree alive
        self._seq = _Clock()
        root = Branch(0, None, 0, 0, self._own(LinearTrajectory()), ROOT_REASON)
        self._branches: dict[int, Branch] = {0: root}
        self._active = 0
        self.metadata: dict = {}  # carried by export when no explicit metadata is given

    def _own(self, traj: LinearTrajectory) -> LinearTrajectory:
        """Stamp `traj`'s commits with this tree's sequence numbers."""
        traj._clock = self._seq
        return traj

    @classmethod
    def from_branches(cls, branches: list[Branch], active_id: int) -> TrajectoryTree:
        """Rebuild a tree (import); checks every invariant, raising `InvariantError`."""
        tree = cls()
        tree._branches = {}
        for b in branches:
            if b.id in tree._branches:
                raise InvariantError(f"duplicate branch id {b.id}")
            tree._branches[b.id] = b
        if active_id not in tree._branches:
            raise InvariantError(f"active branch {active_id} is not in the tree")
        tree._active = active_id
        seqs = [t.seq for b in branches for t in b.trajectory.turns[b.fork_checkpoint :]]
        if len(set(seqs)) != len(seqs) or any(q < 0 for q in seqs):
            raise InvariantError("turn sequence numbers must be distinct and >= 0")
        tree._seq.next = max(seqs, default=-1) + 1
        for b in branches:
            tree._own(b.trajectory)
        tree.check_invariants()
        return tree

    @property
    def active(self) -> Branch:
        return self._branches[self._active]

    @property
    def active_id(self) -> int:
        return self._active

    def get(self, branch_id: int) -> Branch:
        try:
            return self._branches[branch_id]
        except (KeyError, TypeError):
            raise BranchError(f"unknown branch {branch_id!r}") from None

    def branches(self) -> list[Branch]:
        """Every branch, in creation order."""
        return list(self._branches.values())

    def __len__(self) -> int:
        return len(self._branches)

    def unique_tokens(self) -> int:
        """Tokens stored in the tree, each once (what every branch added itself)."""
        return sum(len(b.trajectory.buffer) for b in self._branches.values())

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the tree's tokens (every buffer once, growth slack included)."""
        return sum(b.trajectory.nbytes for b in self._branches.values())

    @property
    def next_seq(self) -> int:
        """The sequence number the next commit gets."""
        return self._seq.next

    def set_next_seq(self, seq: int) -> None:
        """Number the next commit `seq`: a journal replay gives each turn the number it
        had, and an undone commit gives its number back."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise InvariantError(f"a turn sequence number must be an int >= 0, got {seq!r}")
        self._seq.next = seq

    def activate(self, branch_id: int) -> Branch:
        """Make an existing branch the one turns append to."""
        branch = self.get(branch_id)
        self._active = branch.id
        return branch

    def branch_from(self, parent_id: int, checkpoint: int, reason: str, shared: int | None = None) -> Branch:
        """Start a new active branch sharing the parent's prefix up to `checkpoint`, or up
        to `shared` tokens: into the prompt of the parent's next turn, the new branch's
        prompt head (`LinearTrajectory.fork_at`; its next commit opens its first turn)."""
        parent = self.get(parent_id)
        try:
            traj = parent.trajectory.fork_at(checkpoint, shared)
        except CheckpointError as exc:
            raise CheckpointError(f"branch {parent_id}: {exc}") from None
        new_id = max(self._branches) + 1
        branch = Branch(
            id=new_id,
            parent_id=parent.id,
            fork_checkpoint=int(checkpoint),
            fork_index=len(traj),
            trajectory=traj,
            reason=reason,
        )
        self._branches[new_id] = branch
        self._active = new_id
        return branch

    def discard(self, branch_id: int, activate: int) -> None:
        """Remove the newest branch while it holds no turn of its own (a commit that failed
        right after `branch_from`) and make `activate` active again. Its parent keeps the
        pin of the shared tokens (a pin only promises they never change)."""
        branch = self.get(branch_id)
        if branch_id != max(self._branches) or branch.parent_id is None or (
                branch.trajectory.num_turns != branch.fork_checkpoint):
            raise BranchError(f"branch {branch_id} is not a newest branch without turns of its own")
        self.get(activate)
        del self._branches[branch_id]
        self._active = activate

    def commit_turn(self, *args: Any, **kwargs: Any) -> TurnRecord:
        """`LinearTrajectory.commit_turn` on the active branch (stamped with the next seq)."""
        return self.active.trajectory.commit_turn(*args, **kwargs)

    def rollback(self, checkpoint: int) -> Branch:
        """Continue from an earlier checkpoint of the active branch; the old branch is kept."""
        return self.branch_from(self._active, checkpoint, ROLLBACK_REASON)

    def fork(self, reason: str) -> Branch:
        """A new empty active branch (a rewritten history, re-rendered from scratch)."""
        return self.branch_from(self._active, 0, reason)

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless every branch is valid and extends its parent's prefix."""
        roots = [b for b in self._branches.values() if b.parent_id is None]
        if len(roots) != 1:
            raise InvariantError(f"a tree needs exactly one root, found {len(roots)}")
        for b in self._branches.values():
            try:
                b.trajectory.check_invariants()
            except InvariantError as exc:
                raise InvariantError(f"branch {b.id}: {exc}") from None
            if b.parent_id is None:
                if b.fork_checkpoint != 0 or b.fork_index != 0:
                    raise InvariantError(f"root branch {b.id} has a fork point")
                continue
            parent = self._branches.get(b.parent_id)
            if parent is None or b.parent_id >= b.id:
                raise InvariantError(f"branch {b.id} has an invalid parent {b.parent_id}")
            self._check_prefix(parent, b)

    @staticmethod
    def _check_prefix(parent: Branch, child: Branch) -> None:
        p, c, k = parent.trajectory, child.trajectory, child.fork_checkpoint
        where = f"branch {child.id} (parent {parent.id}, checkpoint {k})"
        if not 0 <= k <= p.num_turns:
            raise InvariantError(f"{where}: fork point is not a checkpoint of the parent")
        n, at = child.fork_index, p.checkpoints[k]
        # shared past the checkpoint: only the parent's next prompt, and it opens the
        # branch's own turn k (never a dangling prompt head)
        limit = p.turn(k).output_start if k < p.num_turns else at
        if not at <= n <= limit:
            raise InvariantError(f"{where}: shares {n} tokens, not checkpoint {at} or the prompt after it")
        if k > c.num_turns or c.checkpoints[k] != at or (n > at and (
                k == c.num_turns or c.turn(k).output_start < n)):
            raise InvariantError(f"{where}: fork point is not a checkpoint of the branch")
        if c.shared_len != n:
            raise InvariantError(f"{where}: shares {c.shared_len} tokens, not the {n} before its fork")
        p_ids, p_lps, p_mask = p.arrays(n)
        c_ids, c_lps, c_mask = c.arrays(n)
        if not (
            np.array_equal(p_ids, c_ids)
            and np.array_equal(p_mask, c_mask)
            and np.array_equal(p_lps.view(np.uint32), c_lps.view(np.uint32))
        ):
            raise InvariantError(f"{where}: tokens before the fork differ from the parent's")
        if p.turns[:k] != c.turns[:k]:
            raise InvariantError(f"{where}: turns before the fork differ from the parent's")

    def __repr__(self) -> str:
        return f"TrajectoryTree(branches={len(self._branches)}, active={self._active})"
