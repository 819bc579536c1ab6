"""Training samples over real HTTP: one session's samples, rewards and
metadata, and the streamed batch read of many sessions."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import httpx
import pytest

from session_server.api.models import SAMPLE_METADATA_RESERVED, SampleFormat
from session_server.api.samples import session_samples
from session_server.errors import BadRequest, from_library
from session_server.ops.harness import live_apps
from session_server.sessions import Session, SessionConfig
from trajectory.errors import SampleError
from trajectory.sample_formats import (
    FORMATS,
    MEDIA_TYPES,
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
    samples_to_json,
)
from trajectory.samples import Sample, build_samples, tree_lines

from ..stack import CHAT, Stack, live_stack
from ..trajectory.test_samples import assert_same_samples

LOADERS = {"json": load_samples_json, "npz": load_samples_npz, "safetensors": load_samples_safetensors}

# what every sample's metadata says of a session that set no sampling (the server's default policy)
DEFAULT_SAMPLING = {"policy": "pinned", "values": {}, "seed": None}


def session_of(st: Stack, sid: str) -> Session:
    session: Session = live_apps[st.url].state.ctx.store.get(sid)
    return session


async def episode(st: Stack, sid: str, turns: int = 3, retry: bool = False) -> None:
    """`turns` chat turns that extend one line; with `retry`, the second turn again
    from the same history (a rollback: the first continuation is abandoned)."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    for i in range(turns):
        r = await st.chat(sid, {**CHAT, "messages": msgs})
        assert r.status_code == 200, r.text
        if retry and i == 1:
            r = await st.chat(sid, {**CHAT, "messages": msgs})
            assert r.status_code == 200, r.text
        msgs = [*msgs, r.json()["choices"][0]["message"], {"role": "user", "content": f"Go on ({i})."}]


async def samples(st: Stack, sid: str, fmt: str = "json", **params: Any) -> list[Sample]:
    r = await st.http.get(f"/sessions/{sid}/samples", params={"format": fmt, **params})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == MEDIA_TYPES[fmt]
    return LOADERS[fmt](r.content)


def assert_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == kind, r.text


def test_the_api_offers_the_formats_the_library_writes() -> None:
    assert get_args(SampleFormat) == FORMATS


def test_a_library_sample_error_is_a_400_in_the_error_map() -> None:
    assert isinstance(from_library(SampleError("bad picker")), BadRequest)
    s = Session("s", SessionConfig(ttl_s=60.0), now=0.0)
    with pytest.raises(BadRequest, match="picker"):
        session_samples(s, "nope", None)  # the backstop behind the routes' own checks
    assert session_samples(s, "latest", None) == []


async def test_session_samples_equal_the_library_on_the_session_tree(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(metadata={"task": "t1"})
        await episode(st, sid, turns=3, retry=True)
        tree = session_of(st, sid).tree
        assert len(tree) == 2  # the retry made a rollback branch
        meta = {"task": "t1", "session_id": sid, "sampling": DEFAULT_SAMPLING}
        for picker in ("latest", "all"):
            want = build_samples(tree, picker=picker, metadata=meta)
            for fmt in FORMATS:
                assert_same_samples(await samples(st, sid, fmt, picker=picker), want)
        got = await samples(st, sid)
        assert [s.path for s in got] == [[0, 1]]  # the abandoned continuation is dropped
        assert got[0].metadata == meta and got[0].reward is None and got[0].num_trainable > 0
        # the same as the library on the exported trajectory (whose header metadata differs)
        exported = build_samples({**await st.trajectory(sid), "metadata": {}}, metadata=meta)
        assert_same_samples(got, exported)
        # max_seq_len cuts at a turn boundary
        first_end = got[0].turn_boundaries[1][0]
        cut = await samples(st, sid, max_seq_len=first_end)
        assert len(cut[0]) == first_end and cut[0].status == "truncated" and len(cut[0].turn_boundaries) == 1


async def test_bad_queries_are_400_and_unknown_sessions_404(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await episode(st, sid, turns=1)
        for params in ({"format": "csv"}, {"picker": "nope"}, {"max_seq_len": 0}, {"max_seq_len": -3},
                       {"max_seq_len": "ten"}):
            assert_error(await st.http.get(f"/sessions/{sid}/samples", params=params), 400, "invalid_request")
        assert_error(await st.http.get("/sessions/feed/samples"), 404, "session_not_found")
        empty = await st.session()
        assert await samples(st, empty) == []  # no turn, no leaf, no sample


async def test_reward_broadcast_and_per_leaf_override(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(metadata={"task": "t", "split": "train"})
        await episode(st, sid, turns=2, retry=True)
        leaves = tree_lines(session_of(st, sid).tree).leaves
        assert leaves == [0, 1]

        async def reward(body: dict[str, Any]) -> httpx.Response:
            return await st.http.post(f"/sessions/{sid}/reward", json=body)

        async def rewards() -> dict[int | None, float | None]:
            return {s.leaf: s.reward for s in await samples(st, sid, picker="all")}

        r = await reward({"reward": 1, "metadata": {"split": "eval", "judge": "j"}})
        assert r.status_code == 200, r.text
        merged = {"task": "t", "split": "eval", "judge": "j", "session_id": sid, "sampling": DEFAULT_SAMPLING}
        assert r.json() == {"session_id": sid, "reward": 1.0, "leaf_rewards": {}, "turn_rewards": {},
                            "metadata": merged}
        assert await rewards() == {0: 1.0, 1: 1.0}  # broadcast to every kept leaf
        assert all(s.metadata == merged for s in await samples(st, sid, picker="all"))

        r = await reward({"reward": -0.5, "leaf": 0})
        assert r.status_code == 200, r.text
        assert r.json()["leaf_rewards"] == {"0": -0.5} and r.json()["reward"] == 1.0
        assert await rewards() == {0: -0.5, 1: 1.0}  # the leaf's own overrides
        assert (await samples(st, sid))[0].reward == 1.0  # leaf 0 is not kept by `latest`
        view = (await st.http.get(f"/sessions/{sid}")).json()
        assert view["reward"] == 1.0 and view["leaf_rewards"] == {"0": -0.5}

        assert (await reward({"reward": None})).status_code == 200  # unset the trajectory reward
        assert await rewards() == {0: -0.5, 1: None}
        assert (await reward({"reward": None, "leaf": 0})).status_code == 200  # and the override
        assert await rewards() == {0: None, 1: None}

        for bad in ({"reward": 1.0, "leaf": 7}, {"reward": 1.0, "leaf": -1}, {"reward": "1"}, {"reward": True},
                    {"metadata": {}}, {"reward": 1.0, "extra": 1}, {"reward": 1.0, "metadata": []}):
            assert_error(await reward(bad), 400, "invalid_request")
        r = await st.http.post(f"/sessions/{sid}/reward", content=b'{"reward": 1e400}')
        assert_error(r, 400, "invalid_request")  # not a finite number
        assert_error(await st.http.post("/sessions/feed/reward", json={"reward": 1.0}), 404, "session_not_found")
        assert await rewards() == {0: None, 1: None}  # nothing a refused request carried was kept


async def test_server_owned_metadata_keys_are_refused(qwen3_dir: Path) -> None:
    assert {"session_id", "token_ids", "loss_mask", "reward", "metadata", "path"} <= SAMPLE_METADATA_RESERVED
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(metadata={"task": "t"})
        await episode(st, sid, turns=1)
        for key in sorted(SAMPLE_METADATA_RESERVED):
            assert_error(await st.http.post("/sessions", json={"metadata": {key: 1}}), 400, "invalid_request")
            r = await st.http.post(f"/sessions/{sid}/reward", json={"reward": 1.0, "metadata": {key: "x"}})
            assert_error(r, 400, "invalid_request")
            assert key in r.json()["error"]["message"]
        got = await samples(st, sid)
        assert got[0].metadata == {"task": "t", "session_id": sid, "sampling": DEFAULT_SAMPLING}
        assert got[0].reward is None


async def batch(st: Stack, **body: Any) -> httpx.Response:
    return await st.http.post("/samples", json=body)


async def test_batch_of_three_sessions_in_every_format(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sids = [await st.session(metadata={"i": i}) for i in range(3)]
        await episode(st, sids[0], turns=2, retry=True)
        await episode(st, sids[2], turns=3)  # sids[1] has no turn: no sample
        await st.http.post(f"/sessions/{sids[2]}/reward", json={"reward": 2.0})
        order = [sids[2], sids[1], sids[0]]
        for picker in ("latest", "all"):
            each = [s for sid in order for s in await samples(st, sid, picker=picker)]
            assert [s.metadata["session_id"] for s in each] == [sids[2]] * 1 + [sids[0]] * (1 if picker == "latest" else 2)
            for fmt in FORMATS:
                r = await batch(st, session_ids=order, format=fmt, picker=picker)
                assert r.status_code == 200, r.text
                assert r.headers["content-type"] == MEDIA_TYPES[fmt]
                assert "content-length" not in r.headers  # streamed
                assert_same_samples(LOADERS[fmt](r.content), each)
                if fmt == "json":
                    assert r.content == samples_to_json(each)  # byte-equal to the one-shot payload
        r = await batch(st, session_ids=sids, max_seq_len=1)
        assert all(len(s) == 0 and s.status == "truncated" for s in load_samples_json(r.content))
        for sid in sids:  # close defaults to false
            assert (await st.http.get(f"/sessions/{sid}")).status_code == 200


async def test_close_true_removes_the_sessions_after_reading(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sids = [await st.session() for _ in range(3)]
        for sid in sids:
            await episode(st, sid, turns=1)
        want = [s for sid in sids for s in await samples(st, sid, "safetensors")]
        r = await batch(st, session_ids=sids, close=True, format="safetensors")
        assert r.status_code == 200, r.text
        assert_same_samples(load_samples_safetensors(r.content), want)
        for sid in sids:
            assert_error(await st.http.get(f"/sessions/{sid}"), 404, "session_not_found")
        assert live_apps[st.url].state.ctx.store.all() == {}


async def test_batch_is_validated_whole_before_streaming(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sids = [await st.session() for _ in range(2)]
        await episode(st, sids[0], turns=1)
        # an unknown id: 404 and nothing streamed, nothing closed
        r = await batch(st, session_ids=[sids[0], "feed", sids[1]], close=True)
        assert_error(r, 404, "session_not_found")
        # close with a chat in flight on one of them: 409, nothing closed
        store = live_apps[st.url].state.ctx.store
        s, claim = store.claim(sids[1])
        try:
            assert_error(await batch(st, session_ids=sids, close=True), 409, "session_busy")
            assert (await batch(st, session_ids=sids)).status_code == 200  # reading alone is fine
        finally:
            store.release(s, claim)
        for sid in sids:
            assert (await st.http.get(f"/sessions/{sid}")).status_code == 200
        for body in ({"session_ids": []}, {"session_ids": [sids[0], sids[0]]}, {"session_ids": sids, "format": "csv"},
                     {"session_ids": sids, "picker": "nope"}, {"session_ids": sids, "max_seq_len": 0},
                     {"session_ids": sids, "close": "yes"}, {"session_ids": sids, "extra": 1}, {}):
            assert_error(await batch(st, **body), 400, "invalid_request")
        too_many = [f"{i:032x}" for i in range(10_001)]
        assert_error(await batch(st, session_ids=too_many), 400, "invalid_request")


async def test_other_requests_are_served_while_a_batch_streams(qwen3_dir: Path) -> None:
    """The stream goes one session at a time through the event loop: a client that has
    read only the start of a batch does not keep the server from answering others."""
    async with live_stack(qwen3_dir) as st:
        sids = [await st.session() for _ in range(20)]
        for sid in sids[:2]:
            await episode(st, sid, turns=1)
        async with st.http.stream("POST", "/samples", json={"session_ids": sids, "format": "json"}) as r:
            assert r.status_code == 200
            parts = r.aiter_raw()
            first = await anext(parts)
            assert first.startswith(b'{"format":"tito-samples"')
            async with httpx.AsyncClient(base_url=st.url, timeout=10) as other:
                assert (await other.get("/health")).status_code == 200
                assert (await other.get(f"/sessions/{sids[5]}")).status_code == 200
            rest = b"".join([part async for part in parts])
        assert len(load_samples_json(first + rest)) == 2


@pytest.mark.parametrize("fmt", FORMATS)
async def test_an_empty_batch_of_sessions_without_turns_loads(qwen3_dir: Path, fmt: str) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        r = await batch(st, session_ids=[sid], format=fmt)
        assert r.status_code == 200, r.text
        assert LOADERS[fmt](r.content) == []


async def test_per_turn_rewards_land_on_their_turns_in_every_format_and_the_batch(qwen3_dir: Path) -> None:
    from trajectory.frameworks import to_skyrl, to_verl
    from trajectory.turn_rewards import token_rewards

    async with live_stack(qwen3_dir) as st:
        sid, other = await st.session(), await st.session()
        await episode(st, sid, turns=3, retry=True)  # seqs 0, 1, 2 (abandoned), 3: leaves 0 and 1
        await episode(st, other, turns=1)

        async def reward(body: dict[str, Any], to: str = sid) -> httpx.Response:
            return await st.http.post(f"/sessions/{to}/reward", json=body)

        r = await reward({"turn": 1, "reward": 0.5})
        assert r.status_code == 200, r.text
        assert r.json()["turn_rewards"] == {"1": 0.5} and r.json()["reward"] is None
        r = await reward({"reward": 2.0, "turn_rewards": [{"turn": 3, "reward": -1}, {"turn": 2, "reward": 0.25}]})
        assert r.json()["turn_rewards"] == {"1": 0.5, "2": 0.25, "3": -1.0} and r.json()["reward"] == 2.0
        assert (await reward({"turn": 1, "reward": 0.75})).json()["turn_rewards"]["1"] == 0.75  # replaces
        assert (await reward({"turn": 0, "reward": 0.125})).json()["turn_rewards"]["0"] == 0.125
        assert "0" not in (await reward({"turn": 0, "reward": None})).json()["turn_rewards"]  # null unsets
        want = {"1": 0.75, "2": 0.25, "3": -1.0}
        assert (await st.http.get(f"/sessions/{sid}")).json()["turn_rewards"] == want
        await reward({"reward": 1.0, "turn": 0}, to=other)

        (kept,) = await samples(st, sid)
        # the retry of the second turn (seq 2) replaced seq 1, which only leaf 0's line holds
        assert [d["seq"] for d in kept.diagnostics] == [0, 2, 3] and kept.turn_rewards == [None, 0.25, -1.0]
        assert kept.reward == 2.0  # the trajectory-level reward as before
        values, carried = token_rewards(kept.turn_boundaries, kept.turn_rewards, len(kept))
        ends = [e - 1 for _, _, e in kept.turn_boundaries]
        assert carried.nonzero()[0].tolist() == ends[1:] and values[ends].tolist() == [0.0, 0.25, -1.0]
        assert kept.loss_mask[ends].tolist() == [1, 1, 1]  # on sampled tokens
        every = await samples(st, sid, picker="all")
        assert [s.turn_rewards for s in every] == [[None, 0.75], [None, 0.25, -1.0]]
        for fmt in FORMATS:
            for picker in ("latest", "all"):
                assert_same_samples(await samples(st, sid, fmt, picker=picker), await samples(st, sid, picker=picker))
            r = await batch(st, session_ids=[other, sid], format=fmt)
            got = LOADERS[fmt](r.content)
            assert [s.turn_rewards for s in got] == [[1.0], [None, 0.25, -1.0]]
        response_start = kept.turn_boundaries[0][1]
        sky = to_skyrl([kept])["rewards"][0]
        assert [i + response_start for i, v in enumerate(sky) if v] == ends[1:]
        assert sky[ends[2] - response_start] == -1.0 + 2.0  # the last turn's, plus the trajectory reward
        assert to_verl(kept)["extra_fields"]["turn_scores"] == [None, 0.25, -1.0]

        before = (await st.http.get(f"/sessions/{sid}")).json()["turn_rewards"]
        for bad, field in (({"turn": 4, "reward": 1.0}, "turn: 4"),
                           ({"turn_rewards": [{"turn": 0, "reward": 1}, {"turn": 9, "reward": 1}]},
                            "turn_rewards[1].turn: 9"),
                           ({"turn_rewards": [{"turn": 0, "reward": 1}, {"turn": 0, "reward": 2}]},
                            "turn_rewards[1].turn"),
                           ({"turn": 0, "leaf": 1, "reward": 1.0}, "turn and leaf"),
                           ({"turn": 0, "turn_rewards": [], "reward": 1.0}, "turn and turn_rewards"),
                           ({"turn": 0}, "reward"), ({"turn": -1, "reward": 1.0}, "turn"),
                           ({"turn": True, "reward": 1.0}, "turn"),
                           ({"turn_rewards": [{"turn": 0, "reward": 1, "x": 1}]}, "x"),
                           ({"turn_rewards": [{"turn": 0}]}, "reward")):
            r = await reward(bad)
            assert_error(r, 400, "invalid_request")
            assert field in r.json()["error"]["message"], (bad, r.text)
        assert (await st.http.get(f"/sessions/{sid}")).json()["turn_rewards"] == before  # all or none
        fresh = await st.session()
        r = await reward({"turn": 0, "reward": 1.0}, to=fresh)
        assert_error(r, 400, "invalid_request")
        assert "no committed turn" in r.json()["error"]["message"]
