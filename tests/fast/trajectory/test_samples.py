"""Training samples (the library) from a branch tree, each sampled token trained once.

Property tests build random trees with the real tree API (appends with varying
finish reasons, weight versions and repair tokens; rollbacks, i.e. retries;
forks; going back to an older line, i.e. sub-agent interleaving) while an
oracle records every committed turn with a global id in commit order and
decides by brute force which turns were abandoned, independently of
`trajectory.samples`. Hand-written
trees pin the picker semantics, statuses, truncation and the formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trajectory
from trajectory.errors import ExportError, SampleError
from trajectory.export import to_dict
from trajectory.frameworks import to_verl
from trajectory.sample_formats import (
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
    samples_to_json,
    samples_to_npz,
    samples_to_safetensors,
)
from trajectory.samples import PICKERS, Sample, build_samples, register_picker, status_of
from trajectory.tree import TrajectoryTree

FORMATS = (
    (samples_to_json, load_samples_json),
    (samples_to_npz, load_samples_npz),
    (samples_to_safetensors, load_samples_safetensors),
)
FINISH = ("stop", "tool_calls", "length", "abort", "error")
VERSIONS = (None, 1, 2, 1.0, "v3")


# -- a tree with an oracle -----------------------------------------------------


@dataclass
class Oracle:
    """Every committed turn by global id (its commit time), each branch's line, and the
    conversation each first turn answered."""

    tree: TrajectoryTree = field(default_factory=TrajectoryTree)
    gid: dict[tuple[int, int], int] = field(default_factory=dict)  # (branch, turn) -> id
    line: dict[int, list[int]] = field(default_factory=lambda: {0: []})  # branch -> turn ids
    clock: int = 0
    conv: int = 0  # the conversation a fork starts: its first request differs from the others
    conv_of: dict[int, int] = field(default_factory=dict)  # first turn id -> its conversation

    def commit(self, n_prompt: int, n_sampled: int, repair: int, finish: str, versions: list[Any]) -> None:
        b = self.tree.active
        ids = list(range(self.clock * 10, self.clock * 10 + n_prompt + n_sampled + repair))
        spans = None
        if n_sampled:  # up to len(versions) contiguous spans: [0, 1), [1, 2), ..., [k - 1, n)
            cuts = sorted({0, n_sampled, *range(1, min(len(versions), n_sampled))})
            spans = [(a, z, versions[i]) for i, (a, z) in enumerate(zip(cuts, cuts[1:], strict=False))]
        b.trajectory.commit_turn(
            ids[:n_prompt], ids[n_prompt : n_prompt + n_sampled],
            [-(i + 1) / 8 for i in range(n_sampled)], finish_reason=finish,
            weight_spans=spans, repair_ids=ids[n_prompt + n_sampled :],
            request_messages=[{"role": "user", "content": f"conversation {self.conv}"}]
            if not b.trajectory.num_turns else (),
        )
        if b.trajectory.num_turns == 1:
            self.conv_of[self.clock] = self.conv
        self.gid[(b.id, b.trajectory.num_turns - 1)] = self.clock
        self.line[b.id].append(self.clock)
        self.clock += 1

    def branch(self, checkpoint: int, fork: bool) -> None:
        old = self.tree.active.id
        new = self.tree.fork("new_conversation") if fork else self.tree.rollback(checkpoint)
        self.line[new.id] = self.line[old][: new.fork_checkpoint]
        if fork:
            self.conv = self.clock  # a rewritten history: a new first request
        self.clock += 1

    def retried(self) -> set[int]:
        """Abandoned turns, by brute force over commit times: a turn is abandoned when an
        alternative continuation of the same node (at the root: of the same first
        request) has a later commit somewhere below it than anything below the turn."""
        parent: dict[int, int | None] = {}
        for ids in self.line.values():
            for i, t in enumerate(ids):
                parent[t] = ids[i - 1] if i else None
        below: dict[int, int] = dict.fromkeys(parent, -1)  # latest commit in each subtree
        for u in parent:
            t: int | None = u
            while t is not None:
                below[t] = max(below[t], u)
                t = parent[t]

        def group(t: int) -> Any:
            return ("root", self.conv_of[t]) if parent[t] is None else parent[t]

        return {t for t in parent if any(group(x) == group(t) and below[x] > below[t] for x in parent)}

    def resume(self, pick: float) -> None:
        """Go back to an existing line (a sub-agent interleave, or the agent returns to a
        line it left): later commits extend that branch."""
        leaves = self.leaves()
        b = leaves[int(pick * (len(leaves) - 1))]
        self.tree.activate(b)
        self.conv = self.conv_of[self.line[b][0]]

    def leaves(self) -> list[int]:
        bs = self.tree.branches()
        full = {b.parent_id for b in bs if b.parent_id is not None
                and b.fork_checkpoint == self.tree.get(b.parent_id).trajectory.num_turns}
        return [b.id for b in bs if b.trajectory.num_turns and b.id not in full]


@st.composite
def trees(draw: st.DrawFn) -> Oracle:
    o = Oracle()
    for _ in range(draw(st.integers(1, 14))):
        n_turns = o.tree.active.trajectory.num_turns
        op = draw(st.sampled_from(["turn", "turn", "turn", "retry", "fork", "resume"]))
        if op == "retry" and n_turns:
            o.branch(draw(st.integers(0, n_turns)), fork=False)
        elif op == "fork" and n_turns:
            o.branch(0, fork=True)
        elif op == "resume" and n_turns:
            o.resume(draw(st.floats(0.0, 1.0)))
        o.commit(
            draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(0, 1)),
            draw(st.sampled_from(FINISH)),
            draw(st.lists(st.sampled_from(VERSIONS), min_size=1, max_size=3)),
        )
    return o


def trained_tokens(o: Oracle, samples: list[Sample]) -> dict[tuple[int, int], int]:
    """(turn id, offset in its output) -> number of samples that train it."""
    counts: dict[tuple[int, int], int] = {}
    for s in samples:
        for (_, start, end), d in zip(s.turn_boundaries, s.diagnostics, strict=True):
            g = o.gid[(d["branch"], d["turn"])]
            for k in np.flatnonzero(s.loss_mask[start:end]).tolist():
                counts[(g, k)] = counts.get((g, k), 0) + 1
    return counts


def sampled_tokens(o: Oracle, leaf: int, n_turns: int) -> set[tuple[int, int]]:
    traj = o.tree.get(leaf).trajectory
    out = set()
    for t in traj.turns[:n_turns]:
        g = o.line[leaf][t.index]
        out.update((g, k) for k in range(t.num_sampled))
    return out


def assert_same_samples(a: list[Sample], b: list[Sample]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("token_ids", "loss_mask", "logprobs", "weight_version_index"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and u.shape == v.shape
            assert u.tobytes() == v.tobytes(), name  # bit-exact
        for name in ("turn_boundaries", "status", "reason", "reward", "turn_rewards", "turn_lineage", "metadata",
                     "diagnostics", "path"):
            assert getattr(x, name) == getattr(y, name), name
        assert [(type(v), v) for v in x.version_table] == [(type(v), v) for v in y.version_table]


# -- properties ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(trees(), st.sampled_from(["latest", "all"]))
def test_every_sampled_token_of_a_kept_leaf_is_trained_exactly_once(o: Oracle, picker: str) -> None:
    samples = build_samples(o.tree, picker=picker)
    counts = trained_tokens(o, samples)
    assert set(counts.values()) <= {1}
    for s in samples:
        assert sampled_tokens(o, s.path[-1], len(s.turn_boundaries)) <= set(counts)
        branch = o.tree.get(s.path[-1]).trajectory
        # mask only where the branch sampled; logprobs are the branch's there, 0.0 elsewhere
        assert not (s.loss_mask > branch.mask[: len(s)]).any()
        on = s.loss_mask == 1
        assert np.array_equal(s.logprobs[on], branch.logprobs[: len(s)][on])
        assert not s.logprobs[~on].any()


@settings(max_examples=150, deadline=None)
@given(trees())
def test_latest_picker_drops_exactly_the_lines_with_a_retried_turn(o: Oracle) -> None:
    retried = o.retried()
    samples = build_samples(o.tree)
    kept = [s.path[-1] for s in samples]
    assert kept == [b for b in o.leaves() if not set(o.line[b]) & retried]
    in_samples = {o.gid[(d["branch"], d["turn"])] for s in samples for d in s.diagnostics}
    assert not in_samples & retried  # no abandoned retry's tokens, trainable or not
    assert [s.path[-1] for s in build_samples(o.tree, picker="all")] == o.leaves()


@settings(max_examples=150, deadline=None)
@given(trees(), st.sampled_from(["latest", "all"]))
def test_sample_ids_are_the_paths_committed_ids(o: Oracle, picker: str) -> None:
    for s in build_samples(o.tree, picker=picker):
        leaf = o.tree.get(s.path[-1])
        assert s.path[0] == 0 and all(
            o.tree.get(b).parent_id == a for a, b in zip(s.path, s.path[1:], strict=False)
        )
        assert s.token_ids.dtype == np.int32 and np.array_equal(s.token_ids, leaf.trajectory.ids)
        turns = leaf.trajectory.turns
        assert s.turn_boundaries == [(t.prompt_start, t.output_start, t.output_end) for t in turns]
        assert s.status == status_of(turns[-1].finish_reason) and s.reason is None
        wv = s.weight_version
        for t in turns:
            for a, z, v in t.weight_spans:
                assert all(x is v or (x == v and type(x) is type(v)) for x in wv[a:z])
        assert (s.weight_version_index[~leaf.trajectory.mask.astype(bool)] == -1).all()


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(1, 40), st.sampled_from(["latest", "all"]))
def test_truncation_cuts_only_at_turn_boundaries(o: Oracle, n: int, picker: str) -> None:
    full = build_samples(o.tree, picker=picker)
    cut = build_samples(o.tree, picker=picker, max_seq_len=n)
    assert [s.path for s in cut] == [s.path for s in full]
    for s, f in zip(cut, full, strict=True):
        cps = o.tree.get(s.path[-1]).trajectory.checkpoints
        k = len(s.turn_boundaries)
        assert len(s) == cps[k] <= n and (k == len(cps) - 1 or cps[k + 1] > n)
        assert np.array_equal(s.token_ids, f.token_ids[: len(s)])
        if k < len(cps) - 1:
            assert s.status == "truncated" and s.reason
        if k == 0:
            assert len(s) == 0 and s.loss_mask.dtype == np.uint8 and "max_seq_len" in s.reason
    counts = trained_tokens(o, cut)
    assert set(counts.values()) <= {1}
    for s in cut:
        assert sampled_tokens(o, s.path[-1], len(s.turn_boundaries)) <= set(counts)


@settings(max_examples=60, deadline=None)
@given(trees(), st.one_of(st.none(), st.integers(1, 30)), st.sampled_from(["latest", "all"]))
def test_all_formats_round_trip_exactly(o: Oracle, n: int | None, picker: str) -> None:
    samples = build_samples(o.tree, picker=picker, max_seq_len=n, reward=0.25, metadata={"task": "x"})
    samples += build_samples(to_dict(o.tree), picker="all")  # a batch of two "sessions"
    for dump, load in FORMATS:
        assert_same_samples(load(dump(samples)), samples)


# -- picker semantics, by hand -------------------------------------------------


def _turn(tree: TrajectoryTree, i: int, finish: str = "stop", version: Any = 1, **kw: Any) -> None:
    tree.active.trajectory.commit_turn(
        [i], [100 + i, 200 + i], [-0.5, -0.25], finish_reason=finish, weight_version=version, **kw
    )


def _paths(tree: Any, picker: str = "latest", **kw: Any) -> list[list[int]]:
    return [s.path for s in build_samples(tree, picker=picker, **kw)]


def test_a_retry_drops_the_parents_continuation() -> None:
    t = TrajectoryTree()
    for i in range(3):
        _turn(t, i)
    t.rollback(2)  # the agent re-sent the prefix before turn 3
    _turn(t, 7)
    assert _paths(t) == [[0, 1]]
    assert _paths(t, "all") == [[0], [0, 1]]
    a, b = build_samples(t, picker="all")
    assert a.loss_mask.tolist() == [0, 1, 1] * 3  # the earliest leaf trains the shared turns
    assert b.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    (only,) = build_samples(t)
    assert only.loss_mask.tolist() == [0, 1, 1] * 3 and only.logprobs.tolist() == [0, -0.5, -0.25] * 3


def test_the_latest_of_several_retries_at_one_node_wins() -> None:
    t = TrajectoryTree()
    _turn(t, 0)
    _turn(t, 1)
    t.rollback(1)
    _turn(t, 2)
    t.rollback(1)  # from branch 1, at the same node (after turn 0)
    _turn(t, 3)
    assert _paths(t) == [[0, 1, 2]]
    t.rollback(0)  # a retry at the root replaces everything created before it
    _turn(t, 4)
    assert _paths(t) == [[0, 1, 2, 3]]


def test_a_retry_further_back_drops_the_lines_past_it() -> None:
    t = TrajectoryTree()
    for i in range(3):
        _turn(t, i)
    t.rollback(2)
    _turn(t, 5)
    t.rollback(1)  # branch 2 from branch 1 at checkpoint 1 (a node owned by branch 0)
    _turn(t, 6)
    assert _paths(t) == [[0, 1, 2]]
    assert _paths(t, "all") == [[0], [0, 1], [0, 1, 2]]


def test_a_fork_drops_nothing_but_a_retry_inside_it_does() -> None:
    t = TrajectoryTree()
    _turn(t, 0, request_messages=[{"role": "user", "content": "main task"}])
    _turn(t, 1)
    t.fork("new_conversation")  # a rewritten history (or a sub-agent): both lines are trained
    _turn(t, 2, request_messages=[{"role": "user", "content": "a sub-task"}])
    _turn(t, 3)
    assert _paths(t) == [[0], [0, 1]]
    t.rollback(1)
    _turn(t, 4)
    assert _paths(t) == [[0], [0, 1, 2]]
    samples = build_samples(t)
    assert [s.num_trainable for s in samples] == [4, 4]  # no shared tokens across a fork


def test_a_first_turn_redone_with_the_same_request_competes_at_the_root() -> None:
    t = TrajectoryTree()
    ask = [{"role": "user", "content": "task"}]
    _turn(t, 0, request_messages=ask)
    t.fork("tools_changed")  # same first request: an alternative of the first line
    _turn(t, 1, request_messages=[{"content": "task", "role": "user"}])
    assert _paths(t) == [[0, 1]]
    assert _paths(t, "all") == [[0], [0, 1]]


def test_going_back_to_an_older_line_keeps_it_and_drops_the_retry() -> None:
    """The agent retried turn 1, then resumed the original line: the original has the
    latest commit below the node, so the retry is the abandoned alternative."""
    t = TrajectoryTree()
    _turn(t, 0)
    _turn(t, 1)
    t.rollback(1)
    _turn(t, 2)
    assert _paths(t) == [[0, 1]]
    t.activate(0)
    _turn(t, 3)  # branch 0 continues after its turn 1
    assert _paths(t) == [[0]]
    (only,) = build_samples(t)
    assert only.turn_boundaries[-1][0] == t.get(0).trajectory.turns[-1].prompt_start
    assert _paths(t, "all") == [[0], [0, 1]]


def test_a_branch_continued_from_its_end_is_not_a_leaf() -> None:
    t = TrajectoryTree()
    _turn(t, 0)
    t.rollback(1)  # the child holds the parent's whole line
    _turn(t, 1)
    assert _paths(t, "all") == [[0, 1]]
    empty = TrajectoryTree()
    assert build_samples(empty) == [] and build_samples(empty, picker="all") == []


def test_status_follows_the_last_turns_finish_reason() -> None:
    assert [status_of(r) for r in ("stop", "tool_calls", "length", "abort", "error", "??")] == [
        "completed", "completed", "truncated", "aborted", "aborted", "aborted"]
    t = TrajectoryTree()
    _turn(t, 0, "tool_calls")
    _turn(t, 1, "length", repair_ids=[9])
    (s,) = build_samples(t)
    assert s.status == "truncated" and s.reason is None
    assert s.turn_boundaries == [(0, 1, 3), (3, 4, 6)] and len(s) == 7


def test_max_seq_len_keeps_whole_turns_or_returns_empty_with_a_reason() -> None:
    t = TrajectoryTree()
    _turn(t, 0)
    _turn(t, 1)
    assert len(build_samples(t, max_seq_len=5)[0]) == 3
    (s,) = build_samples(t, max_seq_len=6)
    assert len(s) == 6 and s.status == "completed" and s.reason is None
    (e,) = build_samples(t, max_seq_len=2)
    assert (len(e), e.turn_boundaries, e.status, e.num_trainable) == (0, [], "truncated", 0)
    assert e.reason == "first turn ends at 3 tokens, past max_seq_len 2"
    for arr, dtype in ((e.token_ids, np.int32), (e.loss_mask, np.uint8), (e.logprobs, np.float32)):
        assert arr.shape == (0,) and arr.dtype == dtype
    for bad in (0, -1, True, 2.5, "3"):
        with pytest.raises(SampleError):
            build_samples(t, max_seq_len=bad)  # type: ignore[arg-type]


def test_weight_versions_index_a_table_of_distinct_versions() -> None:
    t = TrajectoryTree()
    t.active.trajectory.commit_turn(
        [1], [2, 3, 4, 5], [-1.0] * 4, finish_reason="stop",
        weight_spans=[(0, 1, 1), (1, 2, 1.0), (2, 3, None), (3, 4, "1")],
    )
    (s,) = build_samples(t)
    assert s.weight_version_index.dtype == np.int32
    assert s.weight_version_index.tolist() == [-1, 0, 1, -1, 2]
    assert [(type(v), v) for v in s.version_table] == [(int, 1), (float, 1.0), (str, "1")]
    assert s.weight_version.tolist() == [None, 1, 1.0, None, "1"]
    for dump, load in FORMATS:
        assert_same_samples(load(dump([s])), [s])


def test_reward_metadata_diagnostics_and_export_input() -> None:
    t = TrajectoryTree()
    t.metadata = {"task": "t1", "seed": 3}
    _turn(t, 0, extra={"parse_status": "ok", "history_rewrite": {"first_diff": 17}})
    t.rollback(0)
    _turn(t, 1, extra={"parse_status": "error", "parse_detail": "bad json"})
    a, b = build_samples(t, picker="all", reward={1: 2}, metadata={"seed": 4})
    assert (a.reward, b.reward) == (None, 2.0) and type(b.reward) is float
    assert a.metadata == b.metadata == {"task": "t1", "seed": 4} and a.metadata is not b.metadata
    assert a.diagnostics == [{"turn": 0, "branch": 0, "seq": 0, "finish_reason": "stop", "repair_tokens": 0,
                              "parse_status": "ok", "parse_detail": None,
                              "history_rewrite": {"first_diff": 17}, "tool_call_id_renames": None,
                              "stale_bound": None, "sampling": None}]
    assert b.diagnostics[0]["parse_detail"] == "bad json" and b.diagnostics[0]["branch"] == 1
    assert [x.reward for x in build_samples(t, picker="all", reward=1)] == [1.0, 1.0]
    assert_same_samples(build_samples(to_dict(t), picker="all"), build_samples(t, picker="all"))
    for bad in (math.nan, math.inf, True, "1", {5: 1.0}, {1: math.nan}):
        with pytest.raises(SampleError):
            build_samples(t, picker="all", reward=bad)  # type: ignore[arg-type]
    with pytest.raises(ExportError):
        build_samples({"format": "nope"})


def test_pickers_are_pluggable_by_name() -> None:
    t = TrajectoryTree()
    _turn(t, 0)
    t.fork("x")
    _turn(t, 1)
    with pytest.raises(SampleError, match="unknown picker"):
        build_samples(t, picker="nope")
    register_picker("last_only", lambda lines: lines.leaves[-1:])
    register_picker("bogus", lambda lines: [99])
    try:
        assert _paths(t, "last_only") == [[0, 1]]
        with pytest.raises(SampleError, match="non-leaves"):
            build_samples(t, picker="bogus")
    finally:
        del PICKERS["last_only"], PICKERS["bogus"]
    assert set(PICKERS) == {"latest", "all"}


def test_samples_feed_the_framework_mappings() -> None:
    t = TrajectoryTree()
    _turn(t, 0, version="w1")
    _turn(t, 1, version="w2")
    out = to_verl(build_samples(t, reward=1.0)[0])
    assert out["prompt_ids"] == [0] and out["response_mask"] == [1, 1, 0, 1, 1]
    assert out["extra_fields"]["weight_versions"] == ["w1", "w2"] and out["reward_score"] == 1.0


# -- formats: layout and malformed payloads --------------------------------------


def _two() -> list[Sample]:
    t = TrajectoryTree()
    _turn(t, 0)
    _turn(t, 1, "length")
    t.rollback(1)
    _turn(t, 2)
    return build_samples(t, picker="all", reward=0.5)


def test_binary_formats_hold_one_concatenated_batch() -> None:
    import io

    import safetensors.numpy

    samples = _two()
    npz = np.load(io.BytesIO(samples_to_npz(samples)), allow_pickle=False)
    tensors = safetensors.numpy.load(samples_to_safetensors(samples))
    for arrays in ({k: npz[k] for k in npz.files}, tensors):
        assert arrays["offsets"].dtype == np.int64 and arrays["offsets"].tolist() == [0, 6, 6 + 6]
        assert arrays["token_ids"].dtype == np.int32 and arrays["loss_mask"].dtype == np.uint8
        assert arrays["logprobs"].dtype == np.float32
        assert np.array_equal(arrays["token_ids"], np.concatenate([s.token_ids for s in samples]))
    for dump, load in FORMATS:
        assert load(dump([])) == []


@pytest.mark.parametrize("dump,load", FORMATS)
def test_malformed_payloads_raise_export_error(dump: Any, load: Any) -> None:
    with pytest.raises(ExportError):
        load(b"\x00garbage")
    good = dump(_two())
    with pytest.raises(ExportError):
        load(good[: len(good) // 2])


def test_json_loader_checks_every_field() -> None:
    import orjson

    good = orjson.loads(samples_to_json(_two()))

    def broken(**change: Any) -> dict[str, Any]:
        d = orjson.loads(orjson.dumps(good))
        d["samples"][0].update(change)
        return d

    for bad in (
        broken(token_ids=[1.5] * 6),
        broken(token_ids=[2**40] * 6),
        broken(loss_mask=[2] * 6),
        broken(logprobs=[-1.0] * 6),  # nonzero where the mask is 0
        broken(weight_version_index=[5] * 6),
        broken(turn_boundaries=[[0, 4, 3]]),
        broken(turn_boundaries=[]),  # mask 1 outside every turn
        broken(status="done"),
        broken(reward="high"),
        broken(path=["a"]),
        broken(extra=1),
        {**good, "version": 2},
    ):
        with pytest.raises(ExportError):
            load_samples_json(bad)
    assert len(load_samples_json(good)) == 2


def test_the_samples_api_is_exported_from_trajectory() -> None:
    for name in ("Sample", "SampleError", "PICKERS", "build_samples", "register_picker",
                 "samples_to_json", "samples_to_npz", "samples_to_safetensors",
                 "load_samples_json", "load_samples_npz", "load_samples_safetensors"):
        assert name in trajectory.__all__ and getattr(trajectory, name) is not None
