"""Export: JSON (through orjson) and npz round trips are exact; bad blobs raise ExportError."""

from __future__ import annotations

import io

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fast.trajectory.test_linear import commit, turn_inputs
from trajectory.errors import ExportError
from trajectory.export import branch_line, from_dict, from_npz_bytes, to_dict, to_npz_bytes
from trajectory.tree import TrajectoryTree


def assert_same(a: TrajectoryTree, b: TrajectoryTree) -> None:
    assert a.active_id == b.active_id
    assert len(a.branches()) == len(b.branches())
    for x, y in zip(a.branches(), b.branches(), strict=True):
        assert (x.id, x.parent_id, x.fork_checkpoint, x.fork_index, x.reason) == (
            y.id,
            y.parent_id,
            y.fork_checkpoint,
            y.fork_index,
            y.reason,
        )
        tx, ty = x.trajectory, y.trajectory
        assert tx.ids.dtype == ty.ids.dtype == np.int32 and np.array_equal(tx.ids, ty.ids)
        assert ty.mask.dtype == np.uint8 and np.array_equal(tx.mask, ty.mask)
        assert ty.logprobs.dtype == np.float32
        assert np.array_equal(tx.logprobs.view(np.uint32), ty.logprobs.view(np.uint32))  # bit-exact
        assert tx.turns == ty.turns
        assert tx.messages() == ty.messages()
        assert tx.checkpoints == ty.checkpoints


def sample_tree() -> TrajectoryTree:
    tree = TrajectoryTree()
    traj = tree.active.trajectory
    traj.commit_turn(
        [1, 2, 3],
        [4, 5],
        [np.float32(-0.1), -1e-30],
        finish_reason="stop",
        weight_version="v1",
        request_messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"}],
        assistant_message={"role": "assistant", "content": None, "tool_calls": [{"id": "call_1"}]},
        engine="sglang-0:1",
        cached_tokens=2,
        extra={"request_id": "r"},
    )
    traj.commit_turn(
        [6],
        [7, 8, 9],
        [-0.3, -0.0, -17.123456789],
        finish_reason="length",
        weight_spans=[(0, 2, 1), (2, 3, 2)],
        repair_ids=[10],
    )
    tree.rollback(1)
    tree.active.trajectory.commit_turn([11], [12], [-2.5], finish_reason="stop")
    tree.fork("new_conversation")
    return tree


def test_to_dict_shape() -> None:
    d = to_dict(sample_tree(), metadata={"task": "t1"})
    assert d["metadata"] == {"task": "t1"} and d["active_branch"] == 2
    b0 = d["branches"][0]
    assert b0["token_ids"] == list(range(1, 11))
    assert b0["loss_mask"] == [0, 0, 0, 1, 1, 0, 1, 1, 1, 0]
    assert [lp for lp, m in zip(b0["logprobs"], b0["loss_mask"], strict=True) if m == 0] == [
        0.0
    ] * 5
    t1 = b0["turns"][1]
    assert t1["weight_spans"] == [[6, 8, 1], [8, 9, 2]] and t1["weight_version"] == 2
    assert t1["repair_tokens"] == 1 and t1["finish_reason"] == "length"
    assert set(b0["turns"][0]) >= {
        "prompt_start",
        "output_start",
        "output_end",
        "end",
        "finish_reason",
        "weight_version",
        "engine",
        "cached_tokens",
        "request_messages",
        "assistant_message",
        "extra",
    }
    assert len(b0["messages"]) == 3
    assert [(b["id"], b["parent_id"], b["reason"]) for b in d["branches"]] == [
        (0, None, "root"),
        (1, 0, "rollback"),
        (2, 1, "new_conversation"),
    ]


def test_round_trips_exact() -> None:
    tree = sample_tree()
    tree.metadata = {"k": [1, 2]}
    d = to_dict(tree)
    back = from_dict(orjson.loads(orjson.dumps(d)))
    assert_same(tree, back)
    assert back.metadata == {"k": [1, 2]}
    assert to_dict(back) == d
    back2 = from_npz_bytes(to_npz_bytes(tree, metadata={"m": 1}))
    assert_same(tree, back2)
    assert back2.metadata == {"m": 1}


_ops = st.lists(
    st.one_of(
        turn_inputs(),
        st.tuples(st.just("rollback"), st.floats(0.0, 1.0)),
        st.tuples(st.just("fork")),
    ),
    max_size=10,
)


@settings(max_examples=80, deadline=None)
@given(_ops, st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3))
def test_random_trees_round_trip(ops: list, metadata: dict) -> None:
    tree = TrajectoryTree()
    for op in ops:
        if isinstance(op, dict):
            commit(tree.active.trajectory, op)
        elif op[0] == "rollback":
            tree.rollback(int(op[1] * tree.active.trajectory.num_turns))
        else:
            tree.fork("rewrite")
    via_json = from_dict(orjson.loads(orjson.dumps(to_dict(tree, metadata=metadata))))
    assert_same(tree, via_json)
    assert via_json.metadata == metadata
    via_npz = from_npz_bytes(to_npz_bytes(tree, metadata=metadata))
    assert_same(tree, via_npz)
    assert via_npz.metadata == metadata


def _corrupt(d: dict, path: tuple, value: object) -> dict:
    d = orjson.loads(orjson.dumps(d))
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value"),
    [
        pytest.param(("format",), "other", id="format"),
        pytest.param(("branches", 0, "token_ids", 0), -1, id="negative-id"),
        pytest.param(("branches", 0, "token_ids", 0), 1.5, id="float-id"),
        pytest.param(("branches", 0, "loss_mask", 0), 1, id="mask-on-prompt"),
        pytest.param(("branches", 0, "logprobs", 0), -1.0, id="logprob-where-mask-0"),
        pytest.param(("branches", 0, "logprobs"), [0.0], id="logprobs-length"),
        pytest.param(("branches", 0, "turns", 0, "end"), 4, id="turn-end"),
        pytest.param(("branches", 0, "turns", 0, "weight_spans"), [], id="spans-missing"),
        pytest.param(("branches", 0, "messages"), [], id="messages-disagree"),
        pytest.param(("branches", 1, "fork_index"), 3, id="fork-index"),
        pytest.param(("branches", 1, "turns", 0, "seq"), 0, id="seq-repeated"),
        pytest.param(("branches", 1, "fork_checkpoint"), 5, id="fork-checkpoint"),
        pytest.param(("branches", 1, "parent_id"), 7, id="unknown-parent"),
        pytest.param(("active_branch",), 9, id="unknown-active"),
        pytest.param(("branches", 0, "turns"), None, id="turns-null"),
        pytest.param(("metadata",), [1], id="metadata-list"),
    ],
)
def test_from_dict_rejects(path: tuple, value: object) -> None:
    d = to_dict(sample_tree())
    from_dict(orjson.loads(orjson.dumps(d)))  # the uncorrupted copy is fine
    with pytest.raises(ExportError):
        from_dict(_corrupt(d, path, value))


def _as_v1(tree: TrajectoryTree) -> dict:
    """The version-1 layout: every branch a full copy of its line (no seq)."""
    d = orjson.loads(orjson.dumps(to_dict(tree)))
    d["version"] = 1
    for b in d["branches"]:
        line = branch_line(to_dict(tree), b["id"])
        b.update(token_ids=line["token_ids"], loss_mask=line["loss_mask"], logprobs=line["logprobs"])
        b["turns"] = line["turns"]
        b["messages"] = [dict(m) for m in tree.get(b["id"]).trajectory.messages()]
        for t in b["turns"]:
            del t["seq"]
    return d


def test_export_stores_each_token_once() -> None:
    """Version 2: a rollback branch exports only what it added after its fork point."""
    tree = sample_tree()
    d = to_dict(tree)
    total = sum(len(b["token_ids"]) for b in d["branches"])
    assert total == tree.unique_tokens()
    child = d["branches"][1]
    assert child["fork_index"] > 0 and len(child["token_ids"]) == len(tree.get(1).trajectory) - child["fork_index"]
    assert [t["index"] for t in child["turns"]] == list(range(child["fork_checkpoint"], tree.get(1).trajectory.num_turns))
    line = branch_line(d, 1)
    assert line["token_ids"] == tree.get(1).trajectory.ids.tolist()


def test_version_1_exports_still_import() -> None:
    tree = sample_tree()
    back = from_dict(_as_v1(tree))
    assert_same(tree, back)
    assert back.unique_tokens() == tree.unique_tokens()  # the copies were dropped on import
    bad = _as_v1(tree)
    bad["branches"][1]["token_ids"][0] = 99  # the copied prefix disagrees with the parent
    with pytest.raises(ExportError):
        from_dict(bad)


def test_unserialisable_metadata_is_an_export_error() -> None:
    with pytest.raises(ExportError):
        to_npz_bytes(sample_tree(), metadata={"x": object()})


def test_from_npz_rejects() -> None:
    with pytest.raises(ExportError):
        from_npz_bytes(b"not an npz")
    sink = io.BytesIO()
    np.savez_compressed(
        sink, meta=np.frombuffer(orjson.dumps(to_dict(sample_tree())), dtype=np.uint8)
    )
    with pytest.raises(ExportError):  # arrays missing from the archive
        from_npz_bytes(sink.getvalue())
    sink = io.BytesIO()
    meta = to_dict(sample_tree())
    arrays = {
        f"b{b['id']}_{k}": np.asarray(b[k])
        for b in meta["branches"]
        for k in ("token_ids", "loss_mask", "logprobs")
    }
    np.savez_compressed(sink, meta=np.frombuffer(orjson.dumps(meta), dtype=np.uint8), **arrays)
    with pytest.raises(ExportError):  # int64/float64 arrays are not the declared dtypes
        from_npz_bytes(sink.getvalue())


def _prompt_fork_tree() -> TrajectoryTree:
    """A fork that shares its parent's next prompt (a rewrite inside a turn's prompt)."""
    tree = TrajectoryTree()
    tree.commit_turn([1, 2, 3], [4], [-0.5], finish_reason="stop",
                     request_messages=[{"role": "user", "content": "a"}], assistant_message={"role": "assistant"})
    tree.commit_turn([5, 6, 7], [8], [-0.25], finish_reason="stop",
                     request_messages=[{"role": "tool", "content": "b"}], assistant_message={"role": "assistant"})
    tree.branch_from(0, 1, "template_rewrite", shared=6)  # [4, 6) of turn 1's prompt shared
    tree.commit_turn([9], [10], [-1.0], finish_reason="stop",
                     request_messages=[{"role": "tool", "content": "c"}], assistant_message={"role": "assistant"})
    return tree


def test_a_fork_sharing_its_parents_prompt_round_trips_and_exports_only_its_own_tokens() -> None:
    tree = _prompt_fork_tree()
    d = to_dict(tree)
    child = d["branches"][1]
    assert (child["fork_checkpoint"], child["fork_index"]) == (1, 6)
    assert child["token_ids"] == [9, 10] and child["turns"][0]["prompt_start"] == 4
    assert_same(tree, from_dict(orjson.loads(orjson.dumps(d))))
    assert_same(tree, from_npz_bytes(to_npz_bytes(tree)))
    assert branch_line(d, 1)["token_ids"] == [1, 2, 3, 4, 5, 6, 9, 10]


@pytest.mark.parametrize("fork_index", [3, 7, 8])
def test_a_fork_index_outside_the_prompt_after_its_checkpoint_is_refused(fork_index: int) -> None:
    """Before the checkpoint, or past the parent's next prompt into what it sampled."""
    d = to_dict(_prompt_fork_tree())
    d["branches"][1]["fork_index"] = fork_index
    with pytest.raises(ExportError):
        from_dict(d)


def test_an_export_with_tokens_after_the_last_turn_is_refused() -> None:
    """Edited arrays with ids past the last turn (mask 0) would become the next turn's
    prompt after import: refused, as before forks could share a prompt head."""
    from trajectory.tree import TrajectoryTree

    tree = TrajectoryTree()
    tree.active.trajectory.commit_turn([1, 2, 3], [10], [-0.5], finish_reason="stop")
    data = to_dict(tree)
    (branch,) = [b for b in data["branches"] if b["turns"]]
    grown = {k: list(v) + [0, 0, 0] for k, v in branch.items()
             if isinstance(v, list) and len(v) == len(branch["token_ids"])}
    branch.update(grown)
    with pytest.raises(ExportError, match="no turn"):
        from_dict(data)


def test_an_exported_tree_with_the_old_single_fork_word_imports_with_the_word_each_branch_gets_now() -> None:
    """Exports written before each meaning had its word name every fork without a known
    cause, and a template's rewrite, `history_rewrite`: import gives each the word journal
    replay gives it (a branch sharing tokens with its parent: the template's fork; a root
    fork: its lineage, else what its request is to the branches before it)."""
    from trajectory.lineage import Lineage

    first = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "fix it"}]
    title = Lineage(agent="title", kind="side", source="x-tito-agent")
    forks = [  # (the request's messages, shared, lineage); the first is the root's own turn
        (first, None, None),
        (first, None, None),  # turn 0 again
        ([{"role": "user", "content": "something else"}], None, None),
        ([first[0], {"role": "user", "content": "fix the other one"}], None, None),
        ([{"role": "system", "content": "Write a title."}, first[1]], None, title),
        (first, 1, None),  # a template's rewrite: shares a token with its parent
    ]
    tree = TrajectoryTree()
    for i, (msgs, shared, lineage) in enumerate(forks):
        if i:
            tree.branch_from(0, 0, "history_rewrite", shared=shared)
        prompt = [1, 2, 3] if shared is None else [2, 3]
        tree.active.trajectory.commit_turn(prompt, [4, 5], [0.0, 0.0], finish_reason="stop", request_messages=msgs,
                                           assistant_message={"role": "assistant", "content": "done"}, lineage=lineage)
    d = orjson.loads(orjson.dumps(to_dict(tree)))
    assert [b["reason"] for b in d["branches"]][1:] == ["history_rewrite"] * 5
    want = ["root", "first_turn_resent", "new_conversation", "history_edited", "side_request", "template_rewrite"]
    assert [b.reason for b in from_dict(d).branches()] == want
    assert [b.reason for b in from_npz_bytes(to_npz_bytes(tree)).branches()] == want
