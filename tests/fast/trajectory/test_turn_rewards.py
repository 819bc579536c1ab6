"""Per-turn rewards in samples: named by seq, one per turn, on the right tokens, in every format.

Random session trees (the oracle of test_samples.py) get rewards on a random subset of
their committed turns; every sample must carry each of its turns' rewards (None where
none was given), the per-token form must put each on that turn's last sampled token,
and over the kept samples each rewarded turn's reward must sit on a trained token
exactly once (the sample that trains the turn).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fast.trajectory.test_samples import FORMATS, Oracle, assert_same_samples, trees
from trajectory.errors import ExportError, SampleError
from trajectory.sample_formats import load_samples_json, samples_to_json
from trajectory.samples import build_samples
from trajectory.tree import TrajectoryTree
from trajectory.turn_rewards import committed_seqs, token_rewards

REWARDS = st.floats(-4, 4, allow_nan=False, width=32)


def _seq(o: Oracle, d: dict) -> int:
    """The seq of a sample's turn, read from the tree by (owner branch, index)."""
    return o.tree.get(d["branch"]).trajectory.turns[d["turn"]].seq


@st.composite
def rewarded_trees(draw: st.DrawFn) -> tuple[Oracle, dict[int, float]]:
    o = draw(trees())
    seqs = sorted(committed_seqs(o.tree.branches()))
    chosen = draw(st.lists(st.sampled_from(seqs), unique=True)) if seqs else []
    return o, {q: draw(REWARDS) for q in chosen}


@settings(max_examples=150, deadline=None)
@given(rewarded_trees(), st.one_of(st.none(), st.integers(1, 30)), st.sampled_from(["latest", "all"]))
def test_per_token_rewards_line_up_with_the_turns_and_the_mask(
        case: tuple[Oracle, dict[int, float]], n: int | None, picker: str) -> None:
    o, rewards = case
    samples = build_samples(o.tree, picker=picker, max_seq_len=n, reward=0.5, turn_rewards=rewards)
    trained_at: dict[int, int] = {}  # rewarded seq -> samples where its reward sits on a trained token
    for s in samples:
        assert s.reward == 0.5  # the trajectory-level reward is untouched
        assert len(s.turn_rewards) == len(s.turn_boundaries) == len(s.diagnostics)
        for d, r in zip(s.diagnostics, s.turn_rewards, strict=True):
            assert d["seq"] == _seq(o, d)
            assert r == rewards.get(d["seq"])  # None where none was given, never 0
        values, carried = token_rewards(s.turn_boundaries, s.turn_rewards, len(s))
        line = o.tree.get(s.path[-1]).trajectory
        assert not (carried.astype(bool) & (line.mask[: len(s)] == 0)).any()  # only on sampled tokens
        expect = {e - 1: r for (_, o_, e), r in zip(s.turn_boundaries, s.turn_rewards, strict=True)
                  if r is not None and e > o_}
        assert np.flatnonzero(carried).tolist() == sorted(expect)
        assert values[sorted(expect)].tolist() == [np.float32(expect[k]) for k in sorted(expect)]
        assert not values[carried == 0].any()
        for (_, o_, e), r, d in zip(s.turn_boundaries, s.turn_rewards, s.diagnostics, strict=True):
            if r is not None and e > o_ and s.loss_mask[e - 1]:
                trained_at[d["seq"]] = trained_at.get(d["seq"], 0) + 1
    # every rewarded turn some sample trains has its reward on a trained token in exactly one sample
    trained_turns = {d["seq"] for s in samples for (_, o_, e), d in zip(s.turn_boundaries, s.diagnostics, strict=True)
                     if e > o_ and s.loss_mask[o_:e].any()}
    assert trained_at == dict.fromkeys(trained_turns & set(rewards), 1)
    for dump, load in FORMATS:
        assert_same_samples(load(dump(samples)), samples)


def _tree(turns: int) -> TrajectoryTree:
    t = TrajectoryTree()
    for i in range(turns):
        t.active.trajectory.commit_turn([i], [100 + i, 200 + i], [-0.5, -0.25], finish_reason="stop")
    return t


def test_a_turn_reward_names_a_committed_seq_and_a_finite_number() -> None:
    t = _tree(2)
    with pytest.raises(SampleError, match="turn 5"):
        build_samples(t, turn_rewards={5: 1.0})
    with pytest.raises(SampleError, match=r"turn_rewards\[1\]"):
        build_samples(t, turn_rewards={1: math.inf})
    (s,) = build_samples(t, turn_rewards={1: 2})
    assert s.turn_rewards == [None, 2.0]


def test_a_payload_from_before_per_turn_rewards_loads_with_none_per_turn() -> None:
    (s,) = build_samples(_tree(2))
    raw = samples_to_json([s]).replace(b'"turn_rewards":[null,null],', b"")
    assert b"turn_rewards" not in raw
    assert load_samples_json(raw)[0].turn_rewards == [None, None]


@pytest.mark.parametrize("bad", [[1.0], [None, "1"], [None, True], "x"])
def test_a_payload_with_malformed_turn_rewards_is_refused(bad: object) -> None:
    (s,) = build_samples(_tree(2))
    s.turn_rewards = bad  # type: ignore[assignment]
    for dump, load in FORMATS:
        with pytest.raises((ExportError, ValueError)):
            load(dump([s]))
