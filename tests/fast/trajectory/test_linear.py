"""LinearTrajectory: atomic commits, checkpoints, rollback and invariants."""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.errors import CheckpointError, InvariantError
from trajectory.linear import LinearTrajectory
from trajectory.sent_forms import form_digest

_ids = st.lists(st.integers(0, 150_000), max_size=12)
_msg = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "tool", "system"]), "content": st.text(max_size=8)}
)


@st.composite
def turn_inputs(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of one valid `commit_turn` call (positional ids under 'args')."""
    prompt = draw(_ids)
    sampled = draw(_ids)
    logprobs = draw(
        st.lists(st.floats(-30.0, 0.0, width=32), min_size=len(sampled), max_size=len(sampled))
    )
    n = len(sampled)
    kw: dict[str, Any] = {
        "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])),
        "repair_ids": draw(st.lists(st.integers(0, 100), max_size=2)),
        "request_messages": draw(st.lists(_msg, max_size=3)),
        "assistant_message": draw(
            st.one_of(st.none(), st.just({"role": "assistant", "content": "a"}))
        ),
        "engine": draw(st.one_of(st.none(), st.just("e0:1"))),
        "cached_tokens": draw(st.integers(0, 50)),
        "extra": draw(st.one_of(st.none(), st.just({"request_id": "r1"}))),
    }
    if n >= 2 and draw(st.booleans()):
        cut = draw(st.integers(1, n - 1))
        kw["weight_spans"] = [(0, cut, draw(st.sampled_from(["1", 3, None]))), (cut, n, "2")]
    else:
        kw["weight_version"] = draw(st.sampled_from([None, "7", 8]))
    kw["args"] = (prompt, sampled, logprobs)
    return kw


def commit(traj: LinearTrajectory, kw: dict[str, Any]):
    kw = dict(kw)
    args = kw.pop("args")
    return traj.commit_turn(*args, **kw)


def snapshot(traj: LinearTrajectory) -> tuple:
    return (
        traj.ids.tolist(),
        traj.mask.tolist(),
        traj.logprobs.tolist(),
        traj.turns,
        traj.checkpoints,
        traj.messages(),
        traj.checkpoint_message_counts,
    )


def test_commit_turn_layout() -> None:
    traj = LinearTrajectory()
    user = {"role": "user", "content": "hi"}
    asst = {"role": "assistant", "content": "yo"}
    t0 = traj.commit_turn(
        [1, 2, 3],
        [4, 5],
        [-0.5, -0.25],
        finish_reason="stop",
        weight_version="v1",
        request_messages=[user],
        assistant_message=asst,
        engine="e",
        cached_tokens=2,
        extra={"k": 1},
    )
    assert (t0.index, t0.prompt_start, t0.output_start, t0.output_end, t0.end) == (0, 0, 3, 5, 5)
    assert (
        t0.weight_spans == ((3, 5, "v1"),) and t0.weight_version == "v1" and t0.repair_tokens == 0
    )
    t1 = traj.commit_turn(
        [6],
        [7, 8, 9],
        [-0.1, -0.2, -0.3],
        finish_reason="length",
        weight_spans=[(0, 1, 1), (1, 3, 2)],
        repair_ids=[10],
    )
    assert (t1.prompt_start, t1.output_start, t1.output_end, t1.end) == (5, 6, 9, 10)
    assert t1.weight_spans == ((6, 7, 1), (7, 9, 2)) and t1.repair_tokens == 1
    assert traj.ids.tolist() == list(range(1, 11))
    assert traj.mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1, 0]
    assert traj.logprobs.tolist() == pytest.approx([0, 0, 0, -0.5, -0.25, 0, -0.1, -0.2, -0.3, 0])
    assert traj.checkpoints == (0, 5, 10)
    assert traj.messages() == [user, asst] and traj.checkpoint_message_counts == (0, 2, 2)
    assert traj.tail(2) == [9, 10] and len(traj) == 10
    traj.check_invariants()


def test_empty_output_turn() -> None:
    traj = LinearTrajectory()
    t = traj.commit_turn([1], [], [], finish_reason="abort", weight_version="3")
    assert t.weight_spans == () and t.weight_version is None and t.output_start == t.output_end == 1
    traj.check_invariants()


_GOOD = ([1, 2], [3, 4], [-0.5, -0.5])


@pytest.mark.parametrize(
    ("args", "kw"),
    [
        pytest.param(([1], [3, 4], [-0.5]), {}, id="logprob-length"),
        pytest.param(([1], [3], [float("nan")]), {}, id="nan-logprob"),
        pytest.param(([1], [3], [float("inf")]), {}, id="inf-logprob"),
        pytest.param(([1], [3], [float("-inf")]), {}, id="-inf-logprob"),
        pytest.param(([1], [3], [-1e39]), {}, id="float32-overflow-logprob"),
        pytest.param(([1], [3], [0.5]), {}, id="positive-logprob"),
        pytest.param(([1], [3], [True]), {}, id="bool-logprob"),
        pytest.param(([1], [3], ["x"]), {}, id="str-logprob"),
        pytest.param(([-1], [3], [-0.5]), {}, id="negative-prompt-id"),
        pytest.param(([1], [-3], [-0.5]), {}, id="negative-sampled-id"),
        pytest.param(([1], [2**31], [-0.5]), {}, id="id-beyond-int32"),
        pytest.param(([1.5], [3], [-0.5]), {}, id="float-id"),
        pytest.param(([True], [3], [-0.5]), {}, id="bool-id"),
        pytest.param(_GOOD, {"repair_ids": [-2]}, id="negative-repair-id"),
        pytest.param(_GOOD, {"weight_spans": [(0, 1, "a")]}, id="spans-short"),
        pytest.param(_GOOD, {"weight_spans": [(0, 1, "a"), (2, 2, "b")]}, id="spans-gap"),
        pytest.param(_GOOD, {"weight_spans": [(0, 1, "a"), (0, 2, "b")]}, id="spans-overlap"),
        pytest.param(_GOOD, {"weight_spans": [(0, 3, "a")]}, id="spans-long"),
        pytest.param(_GOOD, {"weight_spans": [(0, 2)]}, id="spans-pair"),
        pytest.param(
            _GOOD, {"weight_spans": [(0, 2, "a")], "weight_version": "b"}, id="spans-and-version"
        ),
        pytest.param(_GOOD, {"weight_version": True}, id="bool-version"),
        pytest.param(_GOOD, {"cached_tokens": -1}, id="negative-cached"),
        pytest.param(_GOOD, {"finish_reason": ""}, id="empty-finish"),
    ],
)
def test_invalid_commit_raises_and_changes_nothing(args: tuple, kw: dict[str, Any]) -> None:
    traj = LinearTrajectory()
    traj.commit_turn([9], [8], [-1.0], finish_reason="stop", request_messages=[{"role": "user"}])
    before = snapshot(traj)
    kw = {"finish_reason": "stop", **kw}
    with pytest.raises(InvariantError):
        traj.commit_turn(*args, **kw)
    assert snapshot(traj) == before
    traj.check_invariants()


def test_rollback() -> None:
    traj = LinearTrajectory()
    for i in range(3):
        traj.commit_turn(
            [i],
            [10 + i],
            [-1.0],
            finish_reason="stop",
            request_messages=[{"role": "user", "content": str(i)}],
            assistant_message={"role": "assistant", "content": str(i)},
        )
    for i, m in enumerate(traj.messages()):  # every message's form known (history.attach)
        traj.sent_forms.note(i, form_digest(m) or b"")
    traj.rollback(1)
    assert traj.ids.tolist() == [0, 10] and traj.num_turns == 1 and len(traj.messages()) == 2
    # what was known of the removed messages goes with them; the kept ones stay known
    known = [traj.sent_forms.matches(i, form_digest({"role": "user", "content": str(i // 2)}) or b"")
             for i in (0, 2)]
    assert known == [True, False]
    traj.check_invariants()
    for bad in (2, -1, True, "1"):
        with pytest.raises(CheckpointError):
            traj.rollback(bad)  # type: ignore[arg-type]
    traj.rollback(0)
    assert len(traj) == 0 and traj.checkpoints == (0,) and traj.messages() == []


def test_check_invariants_detects_corruption() -> None:
    traj = LinearTrajectory()
    traj.commit_turn([1, 2], [3], [-1.0], finish_reason="stop")
    traj.buffer._mask[0] = 1  # simulate a bug writing through the private storage
    with pytest.raises(InvariantError):
        traj.check_invariants()


def test_commit_cost_does_not_grow_with_context() -> None:
    """Per-turn cost is O(new tokens): no copy of the context per commit (amortised)."""
    traj = LinearTrajectory()
    traj.commit_turn(np.arange(200_000) % 1000, [1], [-1.0], finish_reason="stop")
    caps = set()
    for _ in range(200):
        traj.commit_turn([1, 2], [3], [-1.0], finish_reason="stop")
        caps.add(traj.buffer.capacity)
    assert len(caps) <= 2  # at most one reallocation over 600 new tokens at 200K context


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(turn_inputs(), st.floats(0.0, 1.0)), max_size=12))
def test_random_commits_and_rollbacks_keep_invariants(ops: list) -> None:
    traj = LinearTrajectory()
    model: list[tuple] = []  # per turn: (ids, mask) it added
    for op in ops:
        if isinstance(op, dict):
            turn = commit(traj, op)
            prompt, sampled, _ = op["args"]
            repair = op["repair_ids"]
            model.append(
                (
                    prompt + sampled + repair,
                    [0] * len(prompt) + [1] * len(sampled) + [0] * len(repair),
                )
            )
            assert turn.index == len(model) - 1
        else:
            k = int(op * len(model))
            traj.rollback(k)
            del model[k:]
        traj.check_invariants()
        assert traj.ids.tolist() == [i for ids, _ in model for i in ids]
        assert traj.mask.tolist() == [m for _, mask in model for m in mask]
        assert traj.num_turns == len(model)


def _commit_with_extra(traj: LinearTrajectory, extra: dict[str, Any]) -> Any:
    return traj.commit_turn([1, 2], [3], [-0.5], finish_reason="stop", extra=extra)


def test_an_extra_value_identical_to_the_previous_turns_is_that_turns_object() -> None:
    """One object per episode for the sampling record, not three per turn (a dict and
    its lists), for the cyclic GC to scan."""
    traj = LinearTrajectory()
    sampling = {"policy": "pinned", "engine": {"temperature": 1.0}, "overridden": [], "seeds": []}
    first = _commit_with_extra(traj, {"request_id": "a", "sampling": sampling, "renames": {"x": "y"}})
    again = _commit_with_extra(traj, {"request_id": "b", "sampling": {**sampling, "overridden": []},
                                      "renames": {"x": "z"}})
    assert again.extra["sampling"] is first.extra["sampling"]
    assert again.extra["renames"] == {"x": "z"} and again.extra["request_id"] == "b"
    assert again.extra is not first.extra


class _Policy(enum.StrEnum):
    PINNED = "pinned"


def _looped() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize("differs", [
    {"policy": "pinned", "engine": {"temperature": 1}, "overridden": [], "seeds": []},  # an int for a float
    {"policy": "pinned", "engine": {"temperature": True}, "overridden": [], "seeds": []},  # a bool
    {"seeds": [], "policy": "pinned", "engine": {"temperature": 1.0}, "overridden": []},  # another key order
    {"policy": _Policy.PINNED, "engine": {"temperature": 1.0}, "overridden": [], "seeds": []},  # a subclass
    collections.OrderedDict(policy="pinned", engine={"temperature": 1.0}, overridden=[], seeds=[]),
], ids=["int", "bool", "key_order", "str_enum", "ordered_dict"])
def test_an_extra_value_only_equal_to_the_previous_turns_is_kept_as_given(differs: Any) -> None:
    """Equal in Python is not enough: the record keeps exactly what it was given."""
    traj = LinearTrajectory()
    sampling = {"policy": "pinned", "engine": {"temperature": 1.0}, "overridden": [], "seeds": []}
    _commit_with_extra(traj, {"sampling": sampling})
    assert differs == sampling
    assert _commit_with_extra(traj, {"sampling": differs}).extra["sampling"] is differs


@pytest.mark.parametrize("make", [lambda: {"at": {"a": np.array([1, 2])}},
                                  lambda: {"at": {"a": np.array([])}}, lambda: {"at": {"x": float("nan")}},
                                  lambda: {"at": _looped()}],
                         ids=["array", "empty_array", "nan", "holds_itself"])
def test_an_extra_value_that_is_not_plain_data_commits_as_given(make: Callable[[], dict[str, Any]]) -> None:
    """Arrays (whose `==` is an array), NaN, a list holding itself: committed, unshared."""
    traj = LinearTrajectory()
    _commit_with_extra(traj, make())
    extra = make()
    assert _commit_with_extra(traj, extra).extra["at"] is extra["at"]
