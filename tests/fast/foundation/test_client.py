"""`session_server.client` against a live stack: sync and async, every method,
the error mapping, auth, and the samples API (skipped while its routes are not in the app).

The sync client blocks, and the live stack runs on the test's event loop, so sync flows
run in a worker thread (`asyncio.to_thread`), as they would in a trainer process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from openai import AsyncOpenAI

from session_server.app import AppConfig, create_app
from session_server.client import (
    AsyncSessionClient,
    SessionClient,
    SessionServerError,
    error_from_response,
)
from session_server.context import Settings
from trajectory.sample_formats import samples_to_json, samples_to_npz, samples_to_safetensors
from trajectory.samples import Sample, build_samples
from trajectory.tree import TrajectoryTree

from ..stack import live_stack

ADMIN = "client-admin-token"
MSGS: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]


def _app_routes() -> set[tuple[str, str]]:
    app = create_app(AppConfig(tokenizer="unused"))
    return {(m, getattr(r, "path", "")) for r in app.routes for m in getattr(r, "methods", ()) or ()}


_ROUTES = _app_routes()
SAMPLES_ROUTES = {("GET", "/sessions/{sid}/samples"), ("POST", "/sessions/{sid}/reward"), ("POST", "/samples")}
needs_samples_routes = pytest.mark.skipif(
    not SAMPLES_ROUTES <= _ROUTES,
    reason=f"samples API not in create_app yet (missing {sorted(SAMPLES_ROUTES - _ROUTES)})",
)


def _next_turn(messages: list[dict[str, Any]], reply: dict[str, Any], text: str) -> list[dict[str, Any]]:
    """The agent's next request: its history, our reply as returned, a new user message."""
    assistant = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
    return [*messages, assistant, {"role": "user", "content": text}]


def _sampled_ids(traj: dict[str, Any]) -> list[int]:
    branch = traj["branches"][-1]
    ids, mask = branch["token_ids"], branch["loss_mask"]
    return [t for t, m in zip(ids, mask, strict=True) if m]


# -- the happy path, both clients ------------------------------------------------


def _sync_flow(url: str) -> None:
    with SessionClient(url) as client:
        assert client.health()["status"] == "ok"
        sid = client.create_session(metadata={"task": "t-1"}, ttl_s=60, sampling={"max_tokens": 24})
        assert client.openai_base_url(sid) == f"{url}/sessions/{sid}/v1"
        first = client.chat(sid, MSGS)
        assert first["object"] == "chat.completion"
        second = client.chat(sid, _next_turn(MSGS, first, "Again."), max_tokens=16)
        assert second["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        view = client.session(sid)
        assert (view["session_id"], view["turns"], view["metadata"]) == (sid, 2, {"task": "t-1"})
        traj = client.trajectory(sid)
        assert len(traj["branches"][-1]["turns"]) == 2 and _sampled_ids(traj)
        assert isinstance(client.trajectory(sid, format="npz"), bytes)
        client.close(sid)
        with pytest.raises(SessionServerError) as info:
            client.session(sid)
        assert (info.value.status, info.value.type) == (404, "session_not_found")


async def test_sync_client_create_chat_trajectory_close(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        await asyncio.to_thread(_sync_flow, st.url)


async def test_async_client_create_chat_trajectory_close(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st, AsyncSessionClient(st.url) as client:
        sid = await client.create_session(metadata={"task": "t-2"})
        first = await client.chat(sid, MSGS, max_tokens=24)
        await client.chat(sid, _next_turn(MSGS, first, "Again."), max_tokens=24)
        traj = await client.trajectory(sid)
        assert len(traj["branches"][-1]["turns"]) == 2
        # the trajectory the client reads is the one the server holds
        assert traj == (await st.http.get(f"/sessions/{sid}/trajectory")).json()
        await client.close(sid)
        with pytest.raises(SessionServerError) as info:
            await client.chat(sid, MSGS)
        assert info.value.status == 404 and info.value.type == "session_not_found"


def _sync_control(url: str) -> None:
    with SessionClient(url) as client:
        assert client.pause("abort")["ok"] is True
        assert client.control_state()["paused"]
        client.set_weight_version(3)
        assert client.resume()["ok"] is True
        assert client.control_state()["weight_version"] == 3


async def test_pause_resume_weight_version_sync_and_async(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        await asyncio.to_thread(_sync_control, st.url)
        async with AsyncSessionClient(st.url) as client:
            assert (await client.pause("keep"))["ok"] is True
            assert (await client.resume())["ok"] is True
            with pytest.raises(SessionServerError) as info:
                await client.set_weight_version(2)  # backwards without force
            assert (info.value.status, info.value.type) == (400, "invalid_request")
            await client.set_weight_version(2, force=True)
            assert (await client.control_state())["weight_version"] == 2
            sid = await client.create_session()
            assert (await client.chat(sid, MSGS, max_tokens=8))["choices"]


# -- errors ----------------------------------------------------------------------


async def test_errors_are_typed_from_the_envelope(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st, AsyncSessionClient(st.url) as client:
        with pytest.raises(SessionServerError) as bad:
            await client.create_session(ttl_s=-1)
        assert bad.value.status == 400 and bad.value.type == "invalid_request" and "ttl_s" in bad.value.message
        with pytest.raises(SessionServerError) as unknown:
            await client.session("no-such-session")
        assert (unknown.value.status, unknown.value.type) == (404, "session_not_found")
        sid = await client.create_session()
        with pytest.raises(SessionServerError) as chat_bad:
            await client.chat(sid, [{"role": "wizard", "content": "x"}])
        assert chat_bad.value.status == 400 and "role" in chat_bad.value.message
        with pytest.raises(SessionServerError) as mode:
            await client.pause("sideways")  # type: ignore[arg-type]
        assert mode.value.status == 400
        with pytest.raises(ValueError, match="stream"):
            await client.chat(sid, MSGS, stream=True)
        with pytest.raises(ValueError, match="format"):
            await client.samples(sid, format="csv")  # type: ignore[arg-type]


def test_non_envelope_error_is_http_error() -> None:
    """A reply that is not our envelope (a proxy's page) still raises the typed error."""
    resp = httpx.Response(502, text="<html>Bad gateway</html>", headers={"retry-after": "3"})
    err = error_from_response(resp)
    assert (err.status, err.type, err.retry_after) == (502, "http_error", "3")
    assert "Bad gateway" in err.message
    enveloped = error_from_response(httpx.Response(409, json={"error": {"type": "session_busy", "message": "m"}}))
    assert (enveloped.status, enveloped.type, enveloped.message) == (409, "session_busy", "m")


def test_sync_and_async_clients_send_the_same_requests() -> None:
    """One request builder: both clients put the same method, path, query and body on the wire."""
    seen: dict[str, list[tuple[str, str, bytes, str | None]]] = {"sync": [], "async": []}

    def handler(kind: str) -> Any:
        def reply(request: httpx.Request) -> httpx.Response:
            seen[kind].append((request.method, str(request.url), request.content,
                               request.headers.get("authorization")))
            return httpx.Response(200, json={"ok": True, "session_id": "s1", "api_key": "tok"})
        return reply

    sync = SessionClient("http://x", http=httpx.Client(base_url="http://x", transport=httpx.MockTransport(handler("sync"))))
    aclient = AsyncSessionClient("http://x", http=httpx.AsyncClient(
        base_url="http://x", transport=httpx.MockTransport(handler("async"))))
    sync.create_session(metadata={"a": 1})
    sync.chat("s1", MSGS, temperature=0.5)
    sync.set_reward("s1", 0.5, metadata={"k": "v"}, leaf=2)
    sync.set_reward("s1", -1.0, turn=3)
    sync.pause("wait", lora="a")

    async def run() -> None:
        await aclient.create_session(metadata={"a": 1})
        await aclient.chat("s1", MSGS, temperature=0.5)
        await aclient.set_reward("s1", 0.5, metadata={"k": "v"}, leaf=2)
        await aclient.set_reward("s1", -1.0, turn=3)
        await aclient.pause("wait", lora="a")
        await aclient.disconnect()

    asyncio.run(run())
    sync.disconnect()
    assert seen["sync"] == seen["async"]
    # the session token learnt at creation goes on the agent route only
    assert [auth for *_, auth in seen["sync"]] == [None, "Bearer tok", None, None, None]
    assert orjson.loads(seen["sync"][3][2]) == {"reward": -1.0, "turn": 3}


def test_samples_decode_every_format_and_batch_body() -> None:
    """The client's half of the samples contract, without a server: query and body as
    specified, and each format's payload loaded back into equal `Sample`s."""
    samples = build_samples(_small_tree(), picker="all")
    bodies = {"json": samples_to_json(samples), "npz": samples_to_npz(samples),
              "safetensors": samples_to_safetensors(samples)}
    requests: list[httpx.Request] = []

    def reply(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        fmt = request.url.params.get("format") or orjson.loads(request.content)["format"]
        return httpx.Response(200, content=bodies[fmt])

    with SessionClient("http://x", http=httpx.Client(base_url="http://x", transport=httpx.MockTransport(reply))) as c:
        for fmt in ("json", "npz", "safetensors"):
            got = c.samples("s1", format=fmt, max_seq_len=64)
            assert [s.token_ids.tolist() for s in got] == [s.token_ids.tolist() for s in samples], fmt
            assert [s.path for s in got] == [s.path for s in samples]
        batch = c.batch_samples(["s1", "s2"], close=True, picker="all")
        c.samples("s1", format="json", agent="helper", agent_kind="subagent")
        c.batch_samples(["s1"], format="json", agent_kind="main")
    assert len(batch) == len(samples)
    assert dict(requests[0].url.params) == {"format": "json", "picker": "latest", "max_seq_len": "64"}
    assert requests[0].url.path == "/sessions/s1/samples"
    assert (requests[-3].method, requests[-3].url.path) == ("POST", "/samples")
    assert orjson.loads(requests[-3].content) == {
        "session_ids": ["s1", "s2"], "close": True, "format": "safetensors", "picker": "all"}
    # the agent filter goes in the query and in the batch body, only when given
    assert dict(requests[-2].url.params) == {"format": "json", "picker": "latest", "agent": "helper",
                                             "agent_kind": "subagent"}
    assert orjson.loads(requests[-1].content) == {
        "session_ids": ["s1"], "close": False, "format": "json", "picker": "latest", "agent_kind": "main"}


def _small_tree() -> TrajectoryTree:
    """Two turns, then a retry of the second: two leaves."""
    tree = TrajectoryTree()
    for turn in range(2):
        tree.active.trajectory.commit_turn([1, 2, 3], [10 + turn, 11], [-0.5, -0.25], finish_reason="stop")
    tree.rollback(1)
    tree.active.trajectory.commit_turn([4], [20, 21, 22], [-0.1, -0.2, -0.3], finish_reason="length")
    return tree


# -- auth --------------------------------------------------------------------------


async def test_admin_token_and_session_token(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(admin_token=ADMIN)) as st:
        async with AsyncSessionClient(st.url) as anon:
            with pytest.raises(SessionServerError) as denied:
                await anon.create_session()
            assert (denied.value.status, denied.value.type) == (401, "unauthorized")
        async with AsyncSessionClient(st.url, admin_token=ADMIN) as client:
            sid = await client.create_session()
            token = client.session_token(sid)
            assert token
            # the agent's path: the real openai client on the session's base_url and token
            agent = AsyncOpenAI(base_url=client.openai_base_url(sid), api_key=token, max_retries=0)
            reply = await agent.chat.completions.create(model="m", messages=MSGS, max_tokens=16)  # type: ignore[arg-type]
            await agent.close()
            assert reply.choices[0].message is not None
            assert len((await client.trajectory(sid))["branches"][-1]["turns"]) == 1
            await client.close(sid)
            assert client.session_token(sid) is None


# -- samples API -----------------------------------------------


def _check_sample_matches(sample: Sample, traj: dict[str, Any]) -> None:
    branch = traj["branches"][-1]
    assert sample.token_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert sample.token_ids.tolist() == branch["token_ids"]
    assert sample.loss_mask.tolist() == branch["loss_mask"]


async def _two_turns(client: AsyncSessionClient, **options: Any) -> str:
    sid = await client.create_session(**options)
    first = await client.chat(sid, MSGS, max_tokens=24)
    await client.chat(sid, _next_turn(MSGS, first, "Again."), max_tokens=24)
    return sid


@needs_samples_routes
async def test_samples_in_every_format_and_reward(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st, AsyncSessionClient(st.url) as client:
        sid = await _two_turns(client, metadata={"task": "t-3"})
        traj = await client.trajectory(sid)
        by_format = {fmt: await client.samples(sid, format=fmt) for fmt in ("safetensors", "npz", "json")}
        for fmt, samples in by_format.items():
            assert len(samples) == 1, fmt
            _check_sample_matches(samples[0], traj)
            assert samples[0].metadata.get("task") == "t-3"
            assert samples[0].reward is None
        assert (await client.samples(sid, picker="all"))[0].token_ids.tolist() == traj["branches"][-1]["token_ids"]
        first_turn_end = traj["branches"][-1]["turns"][0]["end"]
        (cut,) = await client.samples(sid, max_seq_len=first_turn_end)
        assert len(cut) == first_turn_end and cut.status == "truncated"
        assert await client.set_reward(sid, 1.5, metadata={"judge": "unit"}) is not None
        (rewarded,) = await client.samples(sid)
        assert rewarded.reward == 1.5 and rewarded.metadata.get("judge") == "unit"
        assert (await client.set_reward(sid, 0.25, turn=0))["turn_rewards"] == {"0": 0.25}
        assert (await client.samples(sid))[0].turn_rewards[0] == 0.25
        with pytest.raises(SessionServerError) as bad_picker:
            await client.samples(sid, picker="no-such-picker")
        assert bad_picker.value.status == 400
        with pytest.raises(SessionServerError) as bad_leaf:
            await client.set_reward(sid, 1.0, leaf=999)
        assert bad_leaf.value.status in (400, 404)


def _sync_batch(url: str) -> None:
    with SessionClient(url) as client:
        sids = [client.create_session(metadata={"i": i}) for i in range(3)]
        for sid in sids:
            client.chat(sid, MSGS, max_tokens=16)
        trajs = {sid: client.trajectory(sid) for sid in sids}
        client.set_reward(sids[0], 0.25)
        samples = client.batch_samples(sids, close=True)
        assert [s.metadata.get("i") for s in samples] == [0, 1, 2]
        for sid, sample in zip(sids, samples, strict=True):
            _check_sample_matches(sample, trajs[sid])
        assert [s.reward for s in samples] == [0.25, None, None]
        for sid in sids:  # close=True closed them
            with pytest.raises(SessionServerError) as gone:
                client.session(sid)
            assert gone.value.status == 404


@needs_samples_routes
async def test_batch_samples_sync_and_async(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        await asyncio.to_thread(_sync_batch, st.url)
        async with AsyncSessionClient(st.url) as client:
            sids = [await _two_turns(client) for _ in range(2)]
            for fmt in ("json", "npz", "safetensors"):
                kept = await client.batch_samples(sids, format=fmt)
                assert len(kept) == 2, fmt
            assert [s.token_ids.tolist() for s in await client.batch_samples(sids, close=True)] == \
                [s.token_ids.tolist() for s in kept]
            with pytest.raises(SessionServerError) as gone:
                await client.session(sids[0])
            assert gone.value.status == 404
