"""Routing replay (R3) rows stored with the tokens and exported.

The simulated SGLang engine answers `return_routed_experts` with deterministic rows
(session_server/sim/routed.py), so the tests recompute what the whole line's rows
must be and compare them with what every export carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from session_server.client import AsyncSessionClient
from session_server.context import Settings
from session_server.sim.routed import DEFAULT_ROUTED, line_rows
from trajectory import from_dict, from_npz_bytes

from ..stack import CHAT, live_stack

R3 = Settings(routed_experts_topk=DEFAULT_ROUTED.topk, routed_experts_num_experts=DEFAULT_ROUTED.num_experts)


def _expected(token_ids: np.ndarray) -> np.ndarray:
    return line_rows(token_ids, DEFAULT_ROUTED)


async def _two_turns(st: Any, sid: str) -> None:
    r = await st.chat(sid)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert "routed_experts" not in r.text  # never echoed to the agent
    body = {**CHAT, "messages": [*CHAT["messages"], msg, {"role": "user", "content": "And now?"}]}
    r = await st.chat(sid, body)
    assert r.status_code == 200 and "routed_experts" not in r.text


async def test_multi_turn_sample_rows_equal_the_engines_rows_for_the_whole_line(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=R3) as st:
        sid = await st.session(routing_replay=True)
        await _two_turns(st, sid)
        log = await st.engine_log()
        client = AsyncSessionClient(st.url)
        samples = {fmt: await client.samples(sid, format=fmt) for fmt in ("json", "npz", "safetensors")}
        traj = await st.trajectory(sid)
        npz = await client.trajectory(sid, format="npz")
        messages = (await st.http.get(f"/sessions/{sid}")).text
    asks = [e["routed_start"] for e in log]
    assert len(asks) == 2 and asks[0] == 0 and asks[1] == len(log[0]["input_ids"]) + len(log[0]["output_ids"]) - 1
    assert "routed_experts\":" not in messages or "start" in messages  # no rows in the session view
    for fmt, got in samples.items():
        (s,) = got
        want = _expected(s.token_ids)
        assert s.routed_experts is not None, fmt
        assert s.routed_experts.dtype == np.uint8, fmt  # 16 experts: the smallest dtype
        assert s.routed_experts.shape == (len(s) - 1, DEFAULT_ROUTED.layers, DEFAULT_ROUTED.topk), fmt
        last_out = s.turn_boundaries[-1][2]
        # rows equal the engine's up to the last sampled token; the repair tail is 0
        np.testing.assert_array_equal(s.routed_experts[: last_out - 1], want[: last_out - 1], err_msg=fmt)
        assert not s.routed_experts[last_out - 1 :].any()
    for tree in (from_dict(traj), from_npz_bytes(npz)):
        turns = tree.get(0).trajectory.turns
        assert [t.routed_experts is not None for t in turns] == [True, True]
        assert turns[1].routed_experts.start == turns[0].output_end - 1  # no gap, no overlap


async def test_routing_replay_is_off_by_default_and_asks_the_engine_for_nothing(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=R3) as st:
        sid = await st.session()
        r = await st.chat(sid)
        assert r.status_code == 200
        log = await st.engine_log()
        client = AsyncSessionClient(st.url)
        (s,) = await client.samples(sid, format="json")
    assert [e["routed_start"] for e in log] == [None]  # the engine was not asked
    assert s.routed_experts is None
