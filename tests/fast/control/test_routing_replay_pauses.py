"""Routed experts (R3) across any number of pauses, token for token.

The sibling of test_resilient.py's property (an interrupted turn equals the
uninterrupted one), with routing replay on: whatever aborts cut the turn into
segments (the simulator's exact `abort_plan`, plus a random storm of control-plane
pauses in any mode), the segments' rows joined by the gap check
(`session_server.routed.join`) are the engine's rows for the turn's positions,
recomputed from the simulator's deterministic function. An in-place pause (`keep`,
SGLang `in_place`) keeps one segment whose rows start where the turn asked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from session_server.control import ControlPlane, ResilientResult, generate_resilient
from session_server.engines import GenerateRequest
from session_server.routed import RoutedShape, join
from session_server.sim import SimModel, running_sim
from session_server.sim.routed import DEFAULT_ROUTED, line_rows
from tests.fast.control.conftest import Spy, make_adapter
from tests.fast.control.test_resilient import _expect, _rid, _storm

SHAPE = RoutedShape(topk=DEFAULT_ROUTED.topk, num_experts=DEFAULT_ROUTED.num_experts)


def _rows(got: ResilientResult, prompt: list[int], start: int) -> np.ndarray:
    """The turn's joined rows, as the server computes them at validate."""
    return join(got.routed_pieces, start=start, end=len(prompt) + len(got.output_ids) - 1, shape=SHAPE)


def _engine_rows(prompt: list[int], got: ResilientResult, start: int) -> np.ndarray:
    return line_rows([*prompt, *(int(t) for t in got.output_ids)], DEFAULT_ROUTED, start)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    protocol=st.sampled_from(["sglang", "vllm"]),
    plan=st.lists(st.integers(1, 9), min_size=0, max_size=6),
    mode=st.sampled_from(["abort", "keep", "wait"]),
    pauses=st.lists(st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 0.02)), min_size=0, max_size=3),
    max_tokens=st.sampled_from([7, 25, 400]),
    start_at=st.sampled_from([0.0, 0.5, 1.0]),
    topic=st.integers(0, 50),
)
def test_routed_rows_equal_the_engines_across_any_aborts(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]], protocol: str, plan: list[int],
    mode: str, pauses: list[tuple[float, float]], max_tokens: int, start_at: float, topic: int,
) -> None:
    prompt = make_prompt(f"task number {topic}: list the files")
    # where the earlier turns' rows end: anywhere in [0, prompt - 1]
    start = int(start_at * (len(prompt) - 1))

    async def scenario() -> None:
        async with running_sim(protocol, qwen3_model, latency_ms=1.0, abort_plan=plan,
                               return_routed_experts=protocol == "vllm") as url:
            spy = Spy(make_adapter(protocol, url))
            control = ControlPlane(lambda: [spy], grace_s=0.005)
            try:
                req = GenerateRequest(_rid(2), prompt, max_tokens, return_routed_experts=True,
                                      routed_experts_start=start)
                storm = asyncio.create_task(_storm(control, mode, pauses))
                got = await generate_resilient(spy, req, control,
                                               expect=_expect(qwen3_model, _rid(2), prompt, max_tokens))
                await storm
            finally:
                await spy.aclose()
        event(f"segments={min(got.segments, 4)}{'+' if got.segments >= 4 else ''}")
        rows = _rows(got, prompt, start)
        want = _engine_rows(prompt, got, start)
        assert rows.dtype == np.uint8  # 16 experts: the smallest dtype
        assert rows.shape == (len(prompt) + len(got.output_ids) - 1 - start, DEFAULT_ROUTED.layers,
                              DEFAULT_ROUTED.topk)
        np.testing.assert_array_equal(rows, want)
        # one piece per segment that kept tokens, each starting where the one before ended
        kept = [r for r in spy.results if r.output_ids or r.finish_reason != "abort"]
        assert len(got.routed_pieces) == len(kept)
        ends = [start] + [p.end for p in got.routed_pieces[:-1]]
        assert [p.start for p in got.routed_pieces] == ends
        if protocol == "sglang":  # each resubmission asked only for the rows it adds
            asked = [r.routed_experts_start for r in spy.requests if r.return_routed_experts]
            assert asked[0] == start and set(asked[1:]) <= {p.start for p in got.routed_pieces}

    asyncio.run(scenario())


async def test_in_place_pause_keeps_one_segment_with_the_engines_rows(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    prompt = make_prompt("read the config and fix the error")
    start = len(prompt) // 2
    async with running_sim("sglang", qwen3_model, latency_ms=3) as url:
        spy = Spy(make_adapter("sglang", url))
        control = ControlPlane(lambda: [spy], grace_s=0.005)
        try:
            req = GenerateRequest(_rid(3), prompt, 400, return_routed_experts=True, routed_experts_start=start)
            task = asyncio.create_task(generate_resilient(spy, req, control))
            # SGLang `in_place` (control/fanout.py maps `keep` to it): the request freezes at the engine
            await _storm(control, "keep", [(0.03, 0.03), (0.02, 0.02)])
            got = await task
        finally:
            await spy.aclose()
    assert got.segments == 1 and got.aborts == 0 and got.paused_wait_s == 0.0
    assert [r.routed_experts_start for r in spy.requests] == [start]
    (piece,) = got.routed_pieces
    assert (piece.start, piece.end) == (start, len(prompt) + len(got.output_ids) - 1)
    np.testing.assert_array_equal(_rows(got, prompt, start), _engine_rows(prompt, got, start))
