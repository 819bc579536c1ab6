"""State that leaks or stalls: loop stalls that grow with
context or session count. Behaviour only (no timing): the TTL sweep pops a heap of
deadlines instead of scanning every session, and the JSON trajectory export is built
in bounded pieces that join to exactly what one `orjson.dumps(to_dict(...))` gave.
The timings themselves are in bench/stall_timings.py and bench/README.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from session_server.sessions import SessionConfig, SessionState, SessionStore
from tests.fast.trajectory.test_export import sample_tree
from tests.fast.trajectory.test_linear import commit, turn_inputs
from trajectory.export import from_dict, to_dict
from trajectory.export_stream import iter_json, to_json_bytes
from trajectory.tree import TrajectoryTree

from ..stack import live_stack


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store_with_clock() -> tuple[SessionStore, Clock]:
    clock = Clock()
    return SessionStore(max_sessions=100_000, clock=clock), clock


def brute_force_due(store: SessionStore, now: float) -> set[str]:
    """The old sweep: a scan of every session."""
    return {sid for sid, s in store.all().items() if s.inflight is None and now - s.last_used > s.config.ttl_s}


# -- TTL sweep -------------------------------------------------------------------


def test_heap_sweep_removes_exactly_the_due_sessions() -> None:
    store, clock = store_with_clock()
    made = {}
    for i in range(50):
        clock.now = float(i)
        made[store.create(SessionConfig(ttl_s=10.0 + (i % 7))).id] = i
    clock.now = 30.0
    want = brute_force_due(store, clock.now)
    assert want and len(want) < 50
    got = store.expire()
    assert set(got) == want and len(got) == len(want)
    assert not want & set(store.all())
    assert not brute_force_due(store, clock.now)
    assert store.expire() == []  # nothing due twice


def test_touched_session_is_not_expired() -> None:
    store, clock = store_with_clock()
    used = store.create(SessionConfig(ttl_s=10.0))
    read = store.create(SessionConfig(ttl_s=10.0))
    idle = store.create(SessionConfig(ttl_s=10.0))
    clock.now = 8.0
    s, claim = store.claim(used.id)  # a chat
    store.release(s, claim)
    read.last_used = clock()  # what a read that refreshes the session does: nothing else
    clock.now = 12.0
    assert store.expire() == [idle.id]
    assert set(store.all()) == {used.id, read.id}
    clock.now = 18.5
    assert sorted(store.expire()) == sorted([used.id, read.id])
    assert len(store) == 0 and store._expiry == []


def test_session_with_a_chat_in_flight_outlives_its_ttl_then_expires() -> None:
    store, clock = store_with_clock()
    s = store.create(SessionConfig(ttl_s=5.0))
    _, claim = store.claim(s.id)
    clock.now = 100.0
    assert store.expire() == []
    clock.now = 200.0
    store.release(s, claim)
    clock.now = 204.0
    assert store.expire() == []
    clock.now = 206.0
    assert store.expire() == [s.id]
    assert s.state is SessionState.CLOSED


def test_removal_via_delete_leaves_no_heap_leak_after_compaction() -> None:
    store, clock = store_with_clock()
    ids = [store.create(SessionConfig(ttl_s=60.0)).id for _ in range(1000)]
    keep = ids[0]
    for sid in ids[1:]:
        store.close(sid)  # what DELETE /sessions/{sid} calls
        assert len(store._expiry) <= 2 * len(store) + 1  # stale entries never dominate
    assert len(store._expiry) <= 3 and keep in {sid for _, sid in store._expiry}
    # a deferred close (DELETE during a chat) goes through the same removal path
    s, claim = store.claim(keep)
    store.close(keep)
    store.release(s, claim)
    assert len(store) == 0 and store._expiry == []
    clock.now = 1000.0
    assert store.expire() == []


def test_limited_sweep_takes_batches_until_none_is_due() -> None:
    store, clock = store_with_clock()
    for _ in range(100):
        store.create(SessionConfig(ttl_s=1.0))
    clock.now = 2.0
    removed: list[str] = []
    batches = 0
    while store.expiry_due():
        batch = store.expire(limit=16)
        assert len(batch) <= 16
        removed += batch
        batches += 1
    assert len(removed) == len(set(removed)) == 100 and batches == 7 and len(store) == 0


@st.composite
def store_ops(draw: st.DrawFn) -> list[tuple[str, Any]]:
    kinds = st.sampled_from(["create", "advance", "touch", "chat", "release", "delete", "expire", "expire_limited"])
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(kinds)
        if kind == "create":
            arg: Any = draw(st.sampled_from([1.0, 2.5, 4.0]))
        elif kind == "advance":
            arg = draw(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]))
        elif kind == "expire_limited":
            arg = draw(st.integers(1, 3))
        else:
            arg = draw(st.integers(0, 1000))  # index into the live sessions
        ops.append((kind, arg))
    return ops


@settings(max_examples=300, deadline=None)
@given(store_ops())
def test_heap_sweep_equals_brute_force_scan(ops: list[tuple[str, Any]]) -> None:
    store, clock = store_with_clock()
    claims: dict[str, Any] = {}
    for kind, arg in ops:
        live = sorted(store.all())
        pick = live[arg % len(live)] if live and isinstance(arg, int) else None
        if kind == "create":
            store.create(SessionConfig(ttl_s=arg))
        elif kind == "advance":
            clock.now += arg
        elif kind == "touch" and pick is not None:
            store.all()[pick].last_used = clock()
        elif kind == "chat" and pick is not None and store.all()[pick].inflight is None:
            if store.all()[pick].state is SessionState.ACTIVE:
                claims[pick] = store.claim(pick)
        elif kind == "release" and claims:
            sid = sorted(claims)[arg % len(claims)]
            s, claim = claims.pop(sid)
            store.release(s, claim)
        elif kind == "delete" and pick is not None and store.all()[pick].state is SessionState.ACTIVE:
            store.close(pick)
        elif kind == "expire":
            want = brute_force_due(store, clock.now)
            assert set(store.expire()) == want
        elif kind == "expire_limited":
            want = brute_force_due(store, clock.now)
            got: list[str] = []
            while store.expiry_due():
                got += store.expire(limit=arg)
            assert sorted(got) == sorted(want)
        assert not any(s.inflight is not None for s in store.all().values() if s.id not in claims)
        # invariant: one entry per live session, stale entries never dominate
        assert {sid for _, sid in store._expiry} >= set(store.all())
        assert len(store._expiry) <= 2 * len(store) + 1
    clock.now += 10.0  # past every TTL: all but the sessions in a chat expire
    want = brute_force_due(store, clock.now)
    assert set(store.expire()) == want and set(store.all()) == set(claims)


# -- chunked JSON export ------------------------------------------------------------


def old_json(tree: TrajectoryTree, metadata: dict[str, Any] | None = None) -> bytes:
    """What the trajectory route returned before: one orjson call over `to_dict`."""
    return orjson.dumps(to_dict(tree, metadata=metadata), option=orjson.OPT_SERIALIZE_NUMPY)


def big_tree(tokens: int) -> TrajectoryTree:
    tree = TrajectoryTree()
    rng = np.random.default_rng(7)
    traj = tree.active.trajectory
    for t in range(70):  # more turns than one piece of records holds
        sampled = rng.integers(0, 150_000, tokens // 140, dtype=np.int32)
        traj.commit_turn(rng.integers(0, 150_000, tokens // 140, dtype=np.int32), sampled,
                         -rng.random(sampled.size, dtype=np.float32), finish_reason="stop",
                         request_messages=[{"role": "user", "content": f"ü {t}"}],
                         assistant_message={"role": "assistant", "content": "x\n" * t})
    tree.rollback(40)
    tree.active.trajectory.commit_turn([1], [2, 3], [np.float32(-1e-30), -0.0], finish_reason="length")
    return tree


def test_chunked_export_is_byte_identical_to_one_orjson_call() -> None:
    meta = {"session_id": "s", "metadata": {"task": "t", "n": [1, 2.5, None]}, "history_policy": "append"}
    for tree in (TrajectoryTree(), sample_tree(), big_tree(20_000)):
        want = old_json(tree, meta)
        assert to_json_bytes(tree, metadata=meta) == want
        assert to_json_bytes(tree) == old_json(tree)
        for chunk in (1, 3, 8192):
            assert b"".join(iter_json(tree, metadata=meta, chunk=chunk)) == want


def test_chunked_export_comes_in_bounded_pieces() -> None:
    tree = big_tree(100_000)
    pieces = list(iter_json(tree, chunk=8192))
    n = len(tree.active.trajectory)
    assert len(pieces) > 3 * (n // 8192)  # the arrays really are split
    # no piece holds more than one chunk of elements (ids are at most 6 digits + a comma)
    assert max(len(p) for p in pieces) < 8192 * 26


@settings(max_examples=60, deadline=None)
@given(st.lists(turn_inputs(), max_size=5), st.integers(1, 5), st.booleans())
def test_chunked_export_equals_old_bytes_on_random_trees(
    turns: list[dict[str, Any]], chunk: int, fork: bool
) -> None:
    tree = TrajectoryTree()
    for kw in turns:
        commit(tree.active.trajectory, kw)
    if fork:
        tree.fork("retry")
    assert b"".join(iter_json(tree, chunk=chunk)) == old_json(tree)


async def test_trajectory_route_serves_the_chunked_export(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st_:
        sid = await st_.session(metadata={"task": "t"})
        for _ in range(2):
            assert (await st_.chat(sid)).status_code == 200
        r = await st_.http.get(f"/sessions/{sid}/trajectory")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        body = r.json()
        tree = from_dict(body)
        meta = {"session_id": sid, "metadata": {"task": "t"}, "history_policy": body["metadata"]["history_policy"]}
        assert r.content == to_json_bytes(tree, metadata=meta) == old_json(tree, meta)
        d = await st_.http.delete(f"/sessions/{sid}", params={"return_trajectory": "true"})
        assert d.status_code == 200 and d.content == r.content
