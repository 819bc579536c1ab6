"""Per-turn (process) rewards: which committed turn a reward names, and where it lands.

A session is a tree of branches, and a turn index alone is ambiguous there (turn 2 of
branch 1 and turn 2 of branch 3 may be different turns, or the same shared one). A
per-turn reward therefore names a turn by its **seq**: the tree's commit counter
(`TurnRecord.seq`), the session's n-th committed turn counting from 0 over every
branch. It is unique in the tree, never reused once a turn is committed, shown as
``seq`` in the trajectory export's turns and in each sample's per-turn
``diagnostics``, and kept over a restart (the journal replays each turn with it).

In a sample, ``turn_rewards`` has one entry per ``turn_boundaries`` entry: the reward
posted for that turn, or None where none was (never 0: "no reward" and "reward 0"
stay apart). A turn shared by several samples' lines carries its reward in each of
them, as the trajectory-level reward is carried by every sample; the loss mask alone
says which sample trains the turn's tokens.

The per-token form (`token_rewards`) puts each turn's reward on the turn's last
sampled token (``output_end - 1``) and 0.0 elsewhere, with a mask of the positions
that carry one: where SkyRL puts a step's reward (NovaSky-AI/SkyRL
skyrl/train/generators/skyrl_gym_generator.py, `_build_per_token_rewards`: "token-level
rewards placed at assistant turn boundaries", at each step's `response_end_idx`). A
turn that sampled no token has no position to carry it; its reward is only in
``turn_rewards``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from trajectory.errors import SampleError


def committed_seqs(branches: Iterable[Any]) -> set[int]:
    """The seq of every turn committed in a tree (each branch's own turns): O(turns)."""
    return {t.seq for b in branches for t in b.trajectory.turns[b.fork_checkpoint:]}


def check_turn_rewards(rewards: Mapping[int, Any] | None, seqs: set[int]) -> dict[int, float]:
    """`rewards` (seq -> finite number) checked against a tree's seqs; `SampleError` names
    the first bad key or value."""
    out: dict[int, float] = {}
    for seq, value in (rewards or {}).items():
        if isinstance(seq, bool) or not isinstance(seq, int) or seq not in seqs:
            raise SampleError(f"turn_rewards names turn {seq!r}, which is no committed turn's seq")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise SampleError(f"turn_rewards[{seq}] must be a finite number, got {value!r}")
        out[seq] = float(value)
    return out


def token_rewards(turn_boundaries: Sequence[Sequence[int]], turn_rewards: Sequence[float | None],
                  n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token rewards (float32 [n], 0.0 where none) and the uint8 mask of the
    positions carrying one: each rewarded turn's last sampled token (module doc)."""
    if len(turn_rewards) != len(turn_boundaries):
        raise SampleError(f"{len(turn_rewards)} turn rewards for {len(turn_boundaries)} turns")
    values = np.zeros(n, dtype=np.float32)
    carried = np.zeros(n, dtype=np.uint8)
    for (_, start, end), r in zip(turn_boundaries, turn_rewards, strict=True):
        if r is not None and end > start:
            values[end - 1] = r
            carried[end - 1] = 1
    return values, carried
