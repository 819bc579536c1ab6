"""Routing replay (R3) through the server: rows across abort -> resubmit (both engine wires),
and a gap, an overlap, a shape or an id out of range in any segment is a 502 with
nothing committed.

The simulated engines answer deterministic rows (session_server/sim/routed.py), so
each test recomputes what the whole line's rows must be. Multi-segment turns come
from the simulator's `abort_plan` (abort right after the k-th sampled token of the
k-th generation), so the segment count is exact, not timing-dependent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from session_server.client import AsyncSessionClient
from session_server.context import Settings
from session_server.sim.routed import DEFAULT_ROUTED, ROUTED_FAULTS, RoutedSpec, line_rows

from ..stack import CHAT, Stack, live_stack

SPEC = DEFAULT_ROUTED
# both settings: the row width is known exactly from the first segment on
STRICT = Settings(routed_experts_topk=SPEC.topk, routed_experts_layers=SPEC.layers,
                  routed_experts_num_experts=SPEC.num_experts)
NEVER = 10_000  # an abort_plan entry past any turn's end: that generation is not cut


def _sim(protocol: str) -> dict[str, Any]:
    """vLLM only answers routed experts when its server flag is on."""
    return {"return_routed_experts": True} if protocol == "vllm" else {}


async def _turn(st: Stack, sid: str, history: list[dict[str, Any]]) -> Any:
    """One turn continuing `history` (the messages so far); the response."""
    body = {**CHAT, "messages": [*history, {"role": "user", "content": f"Step {len(history)}: go on."}]}
    return await st.chat(sid, body)


async def _sample(st: Stack, sid: str) -> Any:
    (s,) = await AsyncSessionClient(st.url).samples(sid, format="npz")
    return s


def _check_line(s: Any) -> None:
    """The sample's rows are the engine's for every forwarded position, `len - 1` in all."""
    assert s.routed_experts is not None
    assert s.routed_experts.shape == (len(s.token_ids) - 1, SPEC.layers, SPEC.topk)
    last_out = s.turn_boundaries[-1][2]
    want = line_rows(s.token_ids, SPEC)
    np.testing.assert_array_equal(s.routed_experts[: last_out - 1], want[: last_out - 1])
    assert not s.routed_experts[last_out - 1 :].any()  # the closing repair tail


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_rows_across_aborts_and_resubmits_equal_the_engines(qwen3_dir: Path, protocol: str) -> None:
    # turn 1: three segments (cut after 2 and 3 tokens); turn 2: whole; turn 3: two segments
    plan = [2, 3, NEVER, NEVER, 1]
    async with live_stack(qwen3_dir, protocol, settings=STRICT, abort_plan=plan, **_sim(protocol)) as st:
        sid = await st.session(routing_replay=True)
        history: list[dict[str, Any]] = []
        for _ in range(3):
            r = await _turn(st, sid, history)
            assert r.status_code == 200, r.text
            assert "routed_experts" not in r.text
            history += [{"role": "user", "content": f"Step {len(history)}: go on."}, r.json()["choices"][0]["message"]]
        log = await st.engine_log()
        s = await _sample(st, sid)
        traj = await st.trajectory(sid)
    assert [e["finish_reason"] for e in log].count("abort") == 3 and len(log) == 6
    _check_line(s)
    turns = traj["branches"][0]["turns"]
    assert [t["extra"]["control"]["segments"] if "control" in t["extra"] else 1 for t in turns] == [3, 1, 2]
    ends = [t["routed_experts"]["start"] + t["routed_experts"]["rows"] for t in turns]
    assert [t["routed_experts"]["start"] for t in turns] == [0, *ends[:-1]]  # no gap, no overlap
    if protocol == "sglang":  # each segment asked only for the positions it added
        starts = [e["routed_start"] for e in log]
        for prev, e, start in zip(log, log[1:], starts[1:], strict=False):
            if prev["finish_reason"] == "abort":
                assert start == len(prev["input_ids"]) + len(prev["output_ids"]) - 1
            assert start <= len(e["input_ids"])


async def _committed(st: Stack, sid: str) -> tuple[int, int, list[int]]:
    view = (await st.http.get(f"/sessions/{sid}")).json()
    ids = (await st.trajectory(sid))["branches"]
    return view["turns"], len(view["branches"]), [len(b.get("token_ids", [])) for b in ids]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("fault", sorted(ROUTED_FAULTS))
@pytest.mark.parametrize("segment", [0, 1])
async def test_bad_rows_in_any_segment_are_a_502_with_nothing_committed(
    qwen3_dir: Path, protocol: str, fault: str, segment: int
) -> None:
    # turn 1 whole; turn 2 cut after 2 tokens (two segments), the fault on `segment`
    async with live_stack(qwen3_dir, protocol, settings=STRICT, abort_plan=[NEVER, 2],
                          **_sim(protocol)) as st:
        sid = await st.session(routing_replay=True)
        r = await _turn(st, sid, [])
        assert r.status_code == 200, r.text
        history = [{"role": "user", "content": "Step 0: go on."}, r.json()["choices"][0]["message"]]
        before = await _committed(st, sid)
        s0 = await _sample(st, sid)
        if segment:
            await st.fault("pass")
        await st.fault(fault)
        r = await _turn(st, sid, history)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["type"] == "upstream_invalid", r.text
        assert await _committed(st, sid) == before  # nothing committed
        s1 = await _sample(st, sid)
        np.testing.assert_array_equal(s1.token_ids, s0.token_ids)
        np.testing.assert_array_equal(s1.routed_experts, s0.routed_experts)
        # the next turn still extends the old line, its rows from where the old ones end
        r = await _turn(st, sid, history)
        assert r.status_code == 200, r.text
        log = await st.engine_log()
        s2 = await _sample(st, sid)
    assert log[-1]["input_ids"][: len(s0.token_ids)] == [int(t) for t in s0.token_ids]
    if protocol == "sglang":
        assert log[-1]["routed_start"] == s0.turn_boundaries[-1][2] - 1
    assert len(s2.turn_boundaries) == 2
    _check_line(s2)


async def test_a_turn_that_changes_the_sessions_shape_is_a_502(qwen3_dir: Path) -> None:
    # only topk set: the width is inferred on the first turn, then held to it
    async with live_stack(qwen3_dir, settings=Settings(routed_experts_topk=SPEC.topk)) as st:
        sid = await st.session(routing_replay=True)
        r = await _turn(st, sid, [])
        assert r.status_code == 200, r.text
        history = [{"role": "user", "content": "Step 0: go on."}, r.json()["choices"][0]["message"]]
        before = await _committed(st, sid)
        await st.fault("routed_layers")
        r = await _turn(st, sid, history)
        assert r.status_code == 502 and "routed" in r.json()["error"]["message"], r.text
        assert await _committed(st, sid) == before


async def test_unsplittable_rows_are_a_502_with_nothing_committed(qwen3_dir: Path) -> None:
    # topk 3 does not divide the simulated 4 x 2 ids per row: a shape mismatch
    async with live_stack(qwen3_dir, settings=Settings(routed_experts_topk=3)) as st:
        sid = await st.session(routing_replay=True)
        r = await st.chat(sid)
        assert r.status_code == 502, r.text
        assert "routed_experts_topk" in r.json()["error"]["message"]
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert view["turns"] == 0 and view["tokens"] == 0 and len(view["branches"]) == 1


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_streamed_turn_commits_the_engines_rows(qwen3_dir: Path, protocol: str) -> None:
    # 200 layers x top-16 of 128: the last frame (~90 positions x 3,200 ids, base64 of
    # int32 on SGLang, of uint8 .npy on vLLM) is past OFFLOAD_FRAME_BYTES, so it is
    # decoded on the offload pool
    big = RoutedSpec(layers=200, topk=16, num_experts=128)
    settings = Settings(routed_experts_topk=16, routed_experts_layers=200, routed_experts_num_experts=128)
    async with live_stack(qwen3_dir, protocol, settings=settings, routed=big, abort_plan=[NEVER, 3],
                          **_sim(protocol)) as st:
        sid = await st.session(routing_replay=True)
        history: list[dict[str, Any]] = []
        for _ in range(2):  # the second turn streams across an abort -> resubmit
            body = {**CHAT, "stream": True,
                    "messages": [*history, {"role": "user", "content": f"Step {len(history)}: go on."}]}
            async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=body) as r:
                text = (await r.aread()).decode()
            assert r.status_code == 200 and "data: [DONE]" in text and "routed_experts" not in text, text[-800:]
            view = await st.trajectory(sid)
            assert view["branches"][-1]["turns"], text[-600:]
            msg = view["branches"][-1]["turns"][-1]["assistant_message"]
            history += [{"role": "user", "content": f"Step {len(history)}: go on."}, msg]
        log = await st.engine_log()
        s = await _sample(st, sid)
    assert [e["finish_reason"] for e in log] == ["stop", "abort", "stop"]
    assert s.routed_experts.shape == (len(s.token_ids) - 1, 200, 16) and s.routed_experts.dtype == np.uint8
    last_out = s.turn_boundaries[-1][2]
    np.testing.assert_array_equal(s.routed_experts[: last_out - 1], line_rows(s.token_ids, big)[: last_out - 1])
