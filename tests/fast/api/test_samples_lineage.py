"""Samples by agent over real HTTP: every sample carries its turns' lineage
(`turn_lineage`) in every format, `GET /sessions/{sid}/samples` and `POST /samples`
select by `agent` / `agent_kind` (the lines holding that agent's turns, only those
trained), an unknown kind is a 400 naming the field, and a journaling server restarted
shows the same lineage in the trajectory, the session's `agents` and the samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from session_server.sim import running_sim
from trajectory.sample_formats import load_samples_json, load_samples_npz, load_samples_safetensors

from ..stack import CHAT, live_stack
from .test_durable_races import _server

LOADERS = {"json": load_samples_json, "npz": load_samples_npz, "safetensors": load_samples_safetensors}
MAIN = {"x-tito-agent": "main", "x-tito-thread": "t-main"}
SUB = {"x-tito-agent": "explorer", "x-tito-thread": "t-sub", "x-tito-parent": "t-main"}
MAIN_LIN = {"agent": "main", "kind": "main", "thread": "t-main", "parent": None, "source": "x-tito-agent"}
SUB_LIN = {"agent": "explorer", "kind": "subagent", "thread": "t-sub", "parent": "t-main", "source": "x-tito-agent"}


async def _episode(http: httpx.AsyncClient, sid: str) -> None:
    """Two main-agent turns on one line, then a sub-agent with a history of its own
    (its own branch, as Claude Code's Agent tool makes one), its two turns on one line."""
    for headers, task in ((MAIN, "Fix the failing test."), (SUB, "Find the test file.")):
        msgs: list[dict[str, Any]] = [{"role": "user", "content": task}]
        for i in range(2):
            r = await http.post(f"/sessions/{sid}/v1/chat/completions", json={**CHAT, "messages": msgs},
                                headers=headers)
            assert r.status_code == 200, r.text
            msgs = [*msgs, r.json()["choices"][0]["message"], {"role": "user", "content": f"Go on ({i})."}]


def _trained_lineage(samples: list[Any]) -> list[dict[str, Any] | None]:
    """The lineage of every turn a sample trains."""
    return [lin for s in samples for (_, o, e), lin in zip(s.turn_boundaries, s.turn_lineage, strict=True)
            if s.loss_mask[o:e].any()]


async def test_samples_carry_turn_lineage_and_select_by_agent_in_every_format(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await _episode(st.http, sid)
        for fmt, load in LOADERS.items():
            async def get(**params: Any) -> list[Any]:
                r = await st.http.get(f"/sessions/{sid}/samples", params={"format": fmt, **params})  # noqa: B023
                assert r.status_code == 200, r.text
                return load(r.content)  # noqa: B023

            everything = await get()
            assert [s.turn_lineage for s in everything] == [[MAIN_LIN] * 2, [SUB_LIN] * 2], fmt
            main = await get(agent_kind="main")
            assert [s.turn_lineage for s in main] == [[MAIN_LIN] * 2]
            assert _trained_lineage(main) == [MAIN_LIN] * 2
            sub = await get(agent="explorer")
            assert [s.turn_lineage for s in sub] == [[SUB_LIN] * 2] and _trained_lineage(sub) == [SUB_LIN] * 2
            both = await get(agent="explorer", agent_kind="subagent")
            assert [(s.path, s.loss_mask.tolist()) for s in both] == [(s.path, s.loss_mask.tolist()) for s in sub]
            assert await get(agent="explorer", agent_kind="main") == []
            assert await get(agent_kind="side") == []
        # the batch takes the same filter, per batch
        r = await st.http.post("/samples", json={"session_ids": [sid], "agent_kind": "subagent"})
        assert r.status_code == 200, r.text
        assert [s.turn_lineage for s in load_samples_json(r.content)] == [[SUB_LIN] * 2]
        r = await st.http.post("/samples", json={"session_ids": [sid], "agent": "main", "format": "safetensors"})
        assert [s.turn_lineage for s in load_samples_safetensors(r.content)] == [[MAIN_LIN] * 2]


async def test_an_unknown_agent_kind_or_an_empty_agent_is_a_400_naming_the_field(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await _episode(st.http, sid)
        for params, field in (({"agent_kind": "boss"}, "agent_kind"), ({"agent": ""}, "agent")):
            r = await st.http.get(f"/sessions/{sid}/samples", params=params)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
            assert field in r.json()["error"]["message"], r.text
            r = await st.http.post("/samples", json={"session_ids": [sid], **params})
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


async def test_a_restarted_server_shows_the_same_lineage_in_the_trajectory_agents_and_samples(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]

    async def seen(http: httpx.AsyncClient, sid: str) -> tuple[Any, ...]:
        traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
        turns = sorted((t for b in traj["branches"] for t in b["turns"]), key=lambda t: t["seq"])
        agents = (await http.get(f"/sessions/{sid}")).json()["agents"]
        samples = load_samples_json((await http.get(f"/sessions/{sid}/samples")).content)
        sub = load_samples_json((await http.get(f"/sessions/{sid}/samples", params={"agent": "explorer"})).content)
        return ([t["lineage"] for t in turns], agents, [s.turn_lineage for s in samples],
                [(s.path, s.loss_mask.tolist()) for s in sub])

    async with running_sim("sglang", str(qwen3)) as engine:
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            await _episode(http, sid)
            before = await seen(http, sid)
        async with _server(qwen3, engine, tmp_path / "j") as (http, _):
            after = await seen(http, sid)
    assert before[0] == [MAIN_LIN] * 2 + [SUB_LIN] * 2
    assert [(a["agent"], a["kind"], a["turns"]) for a in before[1]] == [("main", "main", 2), ("explorer", "subagent", 2)]
    assert before[2] == [[MAIN_LIN] * 2, [SUB_LIN] * 2] and before[3]
    assert after == before
