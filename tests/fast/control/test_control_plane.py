"""ControlPlane: fan-out with per-engine failure reports, modes per protocol, versions, state."""

from __future__ import annotations

import pytest

from session_server.control import ControlPlane
from session_server.engines import SGLangAdapter, VLLMAdapter
from session_server.errors import BadRequest
from session_server.ops.harness import free_port
from session_server.sim import SimModel, running_sim


async def test_fan_out_reports_partial_failures(qwen3_model: SimModel) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_sim("sglang", qwen3_model) as sg, running_sim("vllm", qwen3_model) as vl:
        adapters = [SGLangAdapter(sg, retries=0), VLLMAdapter(vl, retries=0),
                    VLLMAdapter(dead, retries=0, control_timeout_s=2.0)]
        control = ControlPlane(lambda: adapters, grace_s=0.0)
        try:
            report = await control.pause("keep")
            assert not report["ok"] and report["failed"] == [dead]
            assert report["engines"][sg] == {"ok": True, "engine_mode": "in_place"}
            assert report["engines"][vl] == {"ok": True, "engine_mode": "keep"}
            assert "error" in report["engines"][dead]
            assert await adapters[1].is_paused()
            state = control.state()
            assert state["paused"] and state["mode"] == "keep"
            assert state["counters"]["engine_failures"] == 1
            assert state["last_report"]["failed"] == [dead]
            resumed = await control.resume()
            assert resumed["failed"] == [dead] and resumed["was_paused"]
            assert not control.state()["paused"]  # the gate opens even though one engine failed
            assert not await adapters[1].is_paused()
            reg = control.metrics.registry
            assert reg.get_sample_value("tito_control_engine_failures_total", {"op": "pause"}) == 1
            assert reg.get_sample_value("tito_control_pauses_total", {"scope": "global", "mode": "keep"}) == 1
        finally:
            for a in adapters:
                await a.aclose()


async def test_wait_mode_on_sglang_drains_then_freezes(qwen3_model: SimModel) -> None:
    async with running_sim("sglang", qwen3_model) as sg:
        adapter = SGLangAdapter(sg, retries=0)
        control = ControlPlane(lambda: [adapter], grace_s=0.0)
        try:
            report = await control.pause("wait")
            assert report["ok"] and report["drained"] and report["engines_paused"]
            assert report["engines"][sg] == {"ok": True, "engine_mode": "in_place"}
            assert (await control.resume())["ok"]
        finally:
            await adapter.aclose()


async def test_a_wait_pause_that_cannot_drain_pauses_no_engine_and_is_not_ok(qwen3_model: SimModel) -> None:
    """A segment outlives the drain timeout: freezing the engine now would freeze that turn
    and let it go on under the next weights, so no engine is paused, the report is not
    ok and says what is left, and the gate stays closed (defined: paused, engines running)."""
    async with running_sim("sglang", qwen3_model) as sg:
        adapter = SGLangAdapter(sg, retries=0)
        control = ControlPlane(lambda: [adapter], grace_s=0.0, drain_timeout_s=0.1)
        paused: list[str] = []
        real_pause = adapter.pause

        async def spy(mode: str) -> None:
            paused.append(mode)
            await real_pause(mode)

        adapter.pause = spy  # type: ignore[method-assign]
        try:
            with control.track_flight("r-long", engine=sg, lora=None):
                report = await control.pause("wait")
                assert not report["ok"] and report["drained"] is False and report["in_flight"] == 1
                assert report["engines"] == {} and report["engines_paused"] is False
                assert control.blocked() and control.state()["mode"] == "wait"
                assert paused == []  # the engine was never told to pause
            freeze = await control.pause("wait", phase="freeze")  # the gate is still in wait: freezes now
            assert freeze["ok"] and freeze["engines_paused"] and paused == ["in_place"]
            assert (await control.resume())["ok"]
            late = await control.pause("wait", phase="freeze")  # resumed meanwhile: nothing frozen
            assert not late["ok"] and late["superseded"] and late["engines"] == {}
            with pytest.raises(BadRequest):
                await control.pause("abort", phase="drain")
        finally:
            await adapter.aclose()


def test_bad_requests_are_400() -> None:
    control = ControlPlane(lambda: [])
    assert control.cache_salt() is None and control.weight_version is None
    assert control.set_weight_version(2) == {"weight_version": 2, "previous": None, "cache_salt": "wv-2"}
    assert control.set_weight_version(2)["previous"] == 2  # idempotent
    with pytest.raises(BadRequest) as info:
        control.set_weight_version(1)
    assert info.value.status == 400 and "older" in info.value.message
    for bad in (True, -1, 1.5, "3", None):
        with pytest.raises(BadRequest):
            control.set_weight_version(bad)
    assert control.state()["weight_version"] == 2 and control.state()["cache_salt"] == "wv-2"
    assert ControlPlane(lambda: [], salt_cache=False, weight_version=4).cache_salt() is None


async def test_bad_pause_arguments_are_400() -> None:
    control = ControlPlane(lambda: [])
    with pytest.raises(BadRequest):
        await control.pause("nap")
    with pytest.raises(BadRequest):
        await control.pause("abort", lora="")
    assert not control.state()["paused"]


async def test_state_shape() -> None:
    control = ControlPlane(lambda: [], grace_s=0.0)
    await control.pause("abort", lora="x")
    await control.pause("keep")
    state = control.state()
    assert state["paused"] and state["mode"] == "keep" and state["paused_for_s"] >= 0
    assert set(state["lora_pauses"]) == {"x"} and state["lora_pauses"]["x"]["mode"] == "abort"
    assert control.blocked("x") and control.blocked(None)
    await control.resume()
    assert control.blocked("x") and not control.blocked("y") and not control.blocked(None)
    await control.resume(lora="x")
    assert not control.blocked("x")
    assert state["counters"]["pauses"] == 2
    assert control.metrics.registry.get_sample_value("tito_control_paused") == 0


async def test_sim_weight_version_control() -> None:
    import aiohttp

    async with running_sim("sglang", "toy", weight_version="7") as url, aiohttp.ClientSession() as s:
        async with s.get(url + "/sim/weight_version") as r:
            assert await r.json() == {"weight_version": "7"}
        async with s.post(url + "/sim/weight_version", json={"version": True}) as r:
            assert r.status == 400
        async with s.post(url + "/sim/weight_version", json={"version": 8}) as r:
            assert await r.json() == {"weight_version": "8"}
        async with s.get(url + "/get_model_info") as r:
            assert (await r.json())["weight_version"] == "8"


async def test_a_lora_wait_pause_that_cannot_drain_is_not_ok() -> None:
    control = ControlPlane(lambda: [], grace_s=0.0, drain_timeout_s=0.05)
    with control.track_flight("r-lora", engine="http://e", lora="a"):
        report = await control.pause("wait", lora="a")
    assert not report["ok"] and report["drained"] is False and report["in_flight"] == 1
    assert control.blocked("a") and not control.blocked("b")  # that adapter's gate stays closed
    drained = await control.pause("wait", lora="a")
    assert drained["ok"] and drained["drained"] is True
