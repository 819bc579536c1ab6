"""What a session leaves for the cyclic GC: few tracked objects per committed turn, and
no cycles, so a deleted session is freed by reference counting alone.

A session's state lives for its whole episode, and every full GC pass scans each
tracked object in it again (with 2,560 ten-turn sessions open, a full pass took 80-120
ms of the event loop; bench/gc_pauses.py); state kept in a cycle also waits for such a
pass to be freed at all."""

from __future__ import annotations

import gc
import types
from collections import deque
from pathlib import Path
from typing import Any

from session_server.ops.harness import live_apps

from ..stack import Stack, live_stack

_OWNED = (dict, list, tuple, set, deque)


def _tracked_from(root: object) -> int:
    """Tracked objects reachable from `root` through containers and the server's and
    the trajectory library's own objects (not through the loop, modules or classes,
    which every session shares)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not gc.is_tracked(obj):
            continue
        kind = type(obj)
        own = kind in _OWNED or kind.__module__.split(".")[0] in ("session_server", "trajectory")
        if not own or isinstance(obj, type | types.ModuleType):
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return len(seen)


async def _episode(st: Stack, turns: int) -> str:
    sid = await st.session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for k in range(turns):
        r = await st.chat(sid, {"model": "m", "messages": messages, "max_tokens": 8})
        assert r.status_code == 200, r.text
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Now step {k + 1}."}]
    return sid


async def test_a_committed_turn_adds_four_tracked_objects_at_most(qwen3_dir: Path) -> None:
    """The turn record, its request messages and its `extra` dict (and a tuple or so the
    GC does not untrack); the sampling record is the previous turn's object when it is the
    same (it was a dict and two lists more per turn)."""
    async with live_stack(qwen3_dir) as st:
        short, long = await _episode(st, 2), await _episode(st, 12)
        gc.collect()  # what a pass untracks (tuples of atomic values) is not counted
        store = live_apps[st.url].state.ctx.store
        per_turn = (_tracked_from(store.get(long)) - _tracked_from(store.get(short))) / 10
        turns = store.get(long).tree.active.trajectory.turns
    assert per_turn <= 4.0, per_turn
    assert all(t.extra["sampling"] is turns[0].extra["sampling"] for t in turns)


async def test_a_session_leaves_no_cycle_from_create_to_delete(qwen3_dir: Path) -> None:
    """Turns, a fork, a trajectory export and a DELETE: nothing of the server's or the
    trajectory library's ends up as cyclic garbage."""
    async with live_stack(qwen3_dir) as st:
        await st.http.delete(f"/sessions/{await _episode(st, 2)}")  # warm every path once
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            sid = await _episode(st, 3)
            r = await st.chat(sid, {"model": "m", "messages": [{"role": "user", "content": "Another task."}],
                                    "max_tokens": 8})  # a new conversation: a branch from the root
            assert r.status_code == 200, r.text
            assert len((await st.trajectory(sid))["branches"]) == 2
            assert (await st.http.delete(f"/sessions/{sid}")).status_code in (200, 204)
            gc.collect()
            ours = [o for o in gc.garbage
                    if type(o).__module__.split(".")[0] in ("session_server", "trajectory")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert ours == [], sorted({type(o).__qualname__ for o in ours})
