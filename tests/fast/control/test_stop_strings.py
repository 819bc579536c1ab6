"""Stop strings through pauses: a turn aborted on any step, the one that completes a stop
string and every step inside a multi-token one included, then resubmitted, commits
exactly the uninterrupted turn (control/stops.py), on both engines' wires.

The simulator matches stop strings as the engines do (on its own output text only) and
its abort plan aborts right after a sampled token, before the stop check (SGLang's order),
so without the server's own match a resubmission would run past the client's `stop`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from session_server.control import ControlPlane, ResilientResult, generate_resilient
from session_server.engines import GenerateRequest
from session_server.engines.base import SamplingParams, TokenDelta
from session_server.sim import SimModel, running_sim
from tests.fast.control.conftest import make_adapter
from trajectory.validate import Expectations, validate_generation

RID = f"{7:032x}"
MAX_TOKENS = 64


def _expect(model: SimModel, prompt: list[int]) -> Expectations:
    return Expectations(request_id=RID, prompt_len=len(prompt), vocab_size=model.vocab_size,
                        max_tokens=MAX_TOKENS, stop_token_ids=frozenset(model.eos_ids))


def _decode(model: SimModel) -> Callable[[Sequence[Any]], str]:
    return lambda ids: model.decode([int(t) for t in ids])


async def _run(protocol: str, model: SimModel, prompt: list[int], plan: list[int], stop: tuple[str, ...],
               *, stream: bool = False, server_matches: bool = True) -> tuple[ResilientResult, list[int]]:
    """One turn through `generate_resilient`; (the result, the ids a streamed turn showed)."""
    shown: list[int] = []

    def on_delta(delta: TokenDelta) -> None:
        shown.extend(int(t) for t in delta.ids)

    async with running_sim(protocol, model, abort_plan=plan) as url:
        adapter = make_adapter(protocol, url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005)
        try:
            got = await generate_resilient(
                adapter, GenerateRequest(RID, prompt, MAX_TOKENS, sampling=SamplingParams(stop=stop)), control,
                expect=_expect(model, prompt), on_delta=on_delta if stream else None,
                decode=_decode(model) if server_matches else None)
        finally:
            await adapter.aclose()
    return got, shown


def _plan(ends: Sequence[int]) -> list[int]:
    """Segment sizes that abort right after each (1-based) cumulative step in `ends`."""
    plan, prev = [], 0
    for e in sorted(set(ends)):
        if e > prev:
            plan.append(e - prev)
            prev = e
    return plan


async def _stop_turn(protocol: str, model: SimModel, prompt: list[int], at: int, length: int,
                     mid: bool) -> tuple[tuple[str, ...], ResilientResult, int]:
    """A stop string from the turn's own text (tokens [at, at + length), its first character
    dropped when `mid` so it starts inside a token), the uninterrupted turn that stops on
    it, and the step where the string starts."""
    free, _ = await _run(protocol, model, prompt, [], ())
    ids = [int(t) for t in free.output_ids]
    at = min(at, len(ids) - length - 1)
    text = model.decode(ids[at:at + length])
    stop = (text[1:] if mid and len(text.strip()) > 2 else text,)
    ref, _ = await _run(protocol, model, prompt, [], stop)
    assert ref.finish_reason == "stop" and ref.matched_stop == stop[0], ref
    n = len(ref.output_ids)
    full = model.decode(ids[:n])
    # the last k whose tail still holds the string (n - 1 when the last token alone does)
    starts = next((k for k in range(n) if stop[0] not in model.decode(ids[k:n])), n) - 1
    assert stop[0] in full and stop[0] not in model.decode(ids[:n - 1])
    return stop, ref, starts


def _same_turn(got: ResilientResult, ref: ResilientResult, model: SimModel, prompt: list[int]) -> None:
    assert list(got.output_ids) == list(ref.output_ids)
    assert list(got.logprobs) == list(ref.logprobs)
    assert got.finish_reason == "stop" and got.matched_stop == ref.matched_stop
    validate_generation(got, _expect(model, prompt))


def test_aborts_on_any_step_keep_the_stop_string(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    """Hypothesis: aborts anywhere, on the stop step and inside the stop string included,
    streamed or not, on both wires: the committed turn is the uninterrupted one, and a
    streamed turn never shows a token past the stop."""
    inside: list[bool] = []

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        protocol=st.sampled_from(["sglang", "vllm"]),
        topic=st.integers(0, 30),
        at=st.integers(3, 40),
        length=st.integers(2, 4),
        mid=st.booleans(),
        cuts=st.lists(st.floats(0.0, 1.0), max_size=3),
        in_stop=st.lists(st.integers(0, 5), min_size=1, max_size=3),  # at least one abort inside the string
        stream=st.booleans(),
    )
    def prop(protocol: str, topic: int, at: int, length: int, mid: bool, cuts: list[float],
             in_stop: list[int], stream: bool) -> None:
        prompt = make_prompt(f"task number {topic}: read the config")

        async def scenario() -> None:
            stop, ref, starts = await _stop_turn(protocol, qwen3_model, prompt, at, length, mid)
            n = len(ref.output_ids)
            ends = [max(1, min(n, round(c * n))) for c in cuts]
            ends += [min(n, starts + 1 + k) for k in in_stop]  # steps inside the stop string
            got, shown = await _run(protocol, qwen3_model, prompt, _plan(ends), stop, stream=stream)
            _same_turn(got, ref, qwen3_model, prompt)
            if stream:
                assert shown == list(ref.output_ids)
            if ends:
                inside.append(any(starts < e <= n for e in ends))

        asyncio.run(scenario())

    prop()
    assert sum(inside) >= 10, f"only {sum(inside)} examples aborted inside a stop string"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_an_abort_after_every_step_keeps_the_stop_string(
    protocol: str, stream: bool, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]],
) -> None:
    """The harshest plan: every segment is one token, so the stop string is split across
    as many segments as it has tokens and the last one comes back `abort`."""
    prompt = make_prompt("read the config and fix the error")
    stop, ref, starts = await _stop_turn(protocol, qwen3_model, prompt, 12, 3, True)
    n = len(ref.output_ids)
    assert n - starts >= 2, "the stop string spans several tokens"
    got, shown = await _run(protocol, qwen3_model, prompt, [1] * (n + 4), stop, stream=stream)
    _same_turn(got, ref, qwen3_model, prompt)
    assert got.segments == n and got.aborts == n - 1  # the last abort is the stop step: no abort
    if stream:
        assert shown == list(ref.output_ids)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_without_the_server_match_the_turn_runs_past_its_stop(
    protocol: str, qwen3_model: SimModel, make_prompt: Callable[[str], list[int]],
) -> None:
    """What the engines do alone: an abort on the stop step, resubmitted, samples past the
    stop string to the budget (why the server matches)."""
    prompt = make_prompt("read the config and fix the error")
    stop, ref, _ = await _stop_turn(protocol, qwen3_model, prompt, 12, 3, False)
    n = len(ref.output_ids)
    got, _ = await _run(protocol, qwen3_model, prompt, [n], stop, server_matches=False)
    assert len(got.output_ids) > n, got
