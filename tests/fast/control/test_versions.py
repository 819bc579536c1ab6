"""Which weight version sampled each token: the trainer's version, refined only by engine
reports it went through (control/versions.py), against the simulator over HTTP with the
real adapters, and the rules themselves as properties."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from session_server.control import ControlPlane, generate_resilient
from session_server.engines import GenerateRequest
from session_server.engines.base import EngineCapabilities
from session_server.sim import SimModel, running_sim
from tests.fast.control.conftest import Spy, make_adapter
from trajectory.errors import ValidationError

# longer than a turn's budget: a request still sampling when a test pauses it
LONG = " ".join(f"chapter {i} of the story walks the reader through one more room of the house." for i in range(40))


def _rid(n: int) -> str:
    return f"{n:032x}"


async def _post(url: str, body: object) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()


async def test_a_keep_pause_splits_versions_where_the_engine_says_the_update_landed(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    """vLLM 0.32 reports per-token version spans: a request frozen by `keep` across an
    update comes back split, and the committed spans are that split (the trainer's
    versions), not the dispatch version for every token."""
    prompt = make_prompt("tell me a long story")
    async with running_sim("vllm", qwen3_model, latency_ms=4) as url:
        await _post(url + "/sim/script", {"turns": [{"content": LONG}], "session": "story"})  # sampling at the pause
        spy = Spy(make_adapter("vllm", url))
        control = ControlPlane(lambda: [spy], grace_s=0.005)
        try:
            assert (await control.push_weight_version(control.set_weight_version(1)))["ok"]
            request = GenerateRequest(_rid(1), prompt, 300, session_id="story")
            task = asyncio.create_task(generate_resilient(spy, request, control))
            await asyncio.sleep(0.15)
            assert (await control.pause("keep"))["ok"]
            report = await control.push_weight_version(control.set_weight_version(2))
            assert report["ok"] and all(e["pushed"] for e in report["engines"].values())
            assert (await control.resume())["ok"]
            got = await task
        finally:
            await spy.aclose()
    (engine_reply,) = spy.results  # frozen, never resubmitted
    reported = [(s, e, int(v)) for s, e, v in engine_reply.version_spans]
    assert [v for _, _, v in reported] == [1, 2]
    assert got.weight_spans == tuple(reported)
    assert got.version_mismatches == 0


async def test_an_unset_engine_version_never_overrides_the_trainer(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    """SGLang reports `weight_version: "default"` until told otherwise: the trainer's
    version is stamped, and nothing counts as a mismatch."""
    prompt = make_prompt("hello")
    async with running_sim("sglang", qwen3_model) as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], weight_version=3)
        await _post(url + "/sim/weight_version", {"version": "default"})
        try:
            got = await generate_resilient(adapter, GenerateRequest(_rid(2), prompt, 64), control)
        finally:
            await adapter.aclose()
    assert got.weight_spans == ((0, len(got.output_ids), 3),)
    assert got.version_mismatches == 0
    assert control.state()["counters"]["version_mismatches"] == 0


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_the_trainer_version_reaches_every_engine(protocol: str, qwen3_model: SimModel) -> None:
    async with running_sim(protocol, qwen3_model) as url:
        adapter = make_adapter(protocol, url)
        control = ControlPlane(lambda: [adapter])
        try:
            report = await control.push_weight_version(control.set_weight_version(7))
        finally:
            await adapter.aclose()
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(url + "/sim/weight_version") as r:
            assert (await r.json())["weight_version"] == "7"
    assert report["ok"] and report["engines"][url] == {"ok": True, "pushed": True}


_versions = st.one_of(st.none(), st.sampled_from(["default", ""]), st.integers(-3, 20),
                      st.integers(-3, 20).map(str), st.text(max_size=4))


@given(reported=_versions, dispatch=st.one_of(st.none(), st.integers(0, 10)), bump=st.integers(0, 5))
def test_a_stamped_version_is_one_the_trainer_went_through(reported: object, dispatch: int | None, bump: int) -> None:
    """An unset report (None, or `default` / empty once surrounding blanks are stripped, as
    engines pad it) stamps the dispatch version; any other either went through or counts."""
    from session_server.control.versions import UNSET_VERSIONS, resolve_version

    current = bump if dispatch is None else dispatch + bump
    stamped, mismatch = resolve_version(reported, dispatch, current)
    seen = {current} if dispatch is None else set(range(dispatch, current + 1))
    if reported is None or (isinstance(reported, str) and reported.strip() in UNSET_VERSIONS):
        assert stamped == dispatch and not mismatch
    elif mismatch:
        assert stamped == dispatch
    else:
        assert stamped in seen


@given(cuts=st.lists(st.integers(1, 99), max_size=6, unique=True), n=st.integers(100, 200))
def test_engine_spans_must_tile_the_output(cuts: list[int], n: int) -> None:
    from session_server.control.versions import segment_spans

    edges = [0, *sorted(cuts), n]
    spans = [(a, b, str(5 + i % 2)) for i, (a, b) in enumerate(zip(edges, edges[1:], strict=False))]
    stamped, mismatches = segment_spans(n, None, spans, 5, 6)
    assert stamped[0][0] == 0 and stamped[-1][1] == n and mismatches == 0
    assert all(a[1] == b[0] and a[2] != b[2] for a, b in zip(stamped, stamped[1:], strict=False))
    for bad in (spans[:-1], [*spans, (n, n + 1, "6")], [(1, n, "5")]):
        with pytest.raises(ValidationError):
            segment_spans(n, None, bad, 5, 6)


async def test_a_stale_version_on_an_aborted_partial_is_counted_not_a_502(
    qwen3_model: SimModel, make_prompt: Callable[[str], list[int]]
) -> None:
    """An engine that missed the push reports an older version on the partial an `abort`
    pause returns: the partial is kept with the trainer's version and the mismatch counted."""
    prompt = make_prompt("a long answer please")
    async with running_sim("sglang", qwen3_model, latency_ms=4) as url:
        adapter = make_adapter("sglang", url)
        control = ControlPlane(lambda: [adapter], grace_s=0.005, weight_version=5)
        await _post(url + "/sim/weight_version", {"version": "3"})
        await _post(url + "/sim/script", {"turns": [{"content": LONG}], "session": "story"})  # sampling at the pause
        try:
            request = GenerateRequest(_rid(3), prompt, 300, session_id="story")
            task = asyncio.create_task(generate_resilient(adapter, request, control))
            await asyncio.sleep(0.1)
            assert (await control.pause("abort"))["ok"]
            assert (await control.resume())["ok"]
            got = await task
        finally:
            await adapter.aclose()
    assert got.aborts >= 1 and got.weight_spans == ((0, len(got.output_ids), 5),)
    assert got.version_mismatches == got.segments


async def test_a_failed_push_is_reported_per_engine(qwen3_model: SimModel) -> None:
    class Down:
        protocol, base_url = "vllm", "http://down"
        capabilities = EngineCapabilities(pushes_weight_version=True)  # declared: the push reaches it and fails

        async def update_weight_version(self, version: str) -> dict[str, object]:
            raise ConnectionError("refused")

    async with running_sim("vllm", qwen3_model) as url:
        up = make_adapter("vllm", url)
        control = ControlPlane(lambda: [up, Down()])  # type: ignore[list-item]
        try:
            report = await control.push_weight_version(control.set_weight_version(4))
        finally:
            await up.aclose()
    assert not report["ok"] and report["failed"] == ["http://down"]
    assert "refused" in str(report["engines"]["http://down"]), report  # its own failure, not a missing capability
    assert report["engines"][url] == {"ok": True, "pushed": True}
    assert control.weight_version == 4, "the version applies here even when an engine missed it"


@pytest.mark.parametrize("junk", [{"v": 1}, [1], True, float("nan")])
def test_a_version_that_is_not_a_string_or_number_is_bad_engine_output(junk: object) -> None:
    from session_server.control.versions import resolve_version

    for dispatch, current in ((None, None), (2, 3)):
        with pytest.raises(ValidationError):
            resolve_version(junk, dispatch, current)


def test_digit_lookalikes_are_strings_not_versions() -> None:
    from session_server.control.versions import resolve_version

    assert resolve_version("²", 2, 3) == (2, True)
    assert resolve_version("--5", 2, 3) == (2, True)
    assert resolve_version("²", None, None) == ("²", False)
    assert resolve_version("3", None, 3) == (3, False)  # the first version arrived mid-segment
    assert resolve_version("-3", None, 3) == (None, True)
    assert resolve_version("2", 5, 2) == (2, False)  # forced back to 2: both versions it saw
    assert resolve_version("4", 5, 2) == (5, True)
