"""Sampling policy through real HTTP and real clients: under `pinned` the session's
sampling values reach the engine whatever a harness sends (its own temperature on a side
request is recorded per turn, never sent); under `client` the request's do; every
dialect obeys it; the server's default is `pinned` and a session's choice wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from session_server.context import Settings

from ..stack import Stack, live_stack
from .test_samples_api import samples

MSGS: list[Any] = [{"role": "user", "content": "Fix the failing test."}]
TRAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def _oai(st: Stack, sid: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)


async def _turns(st: Stack, sid: str) -> list[dict[str, Any]]:
    return [t for b in (await st.trajectory(sid))["branches"] for t in b["turns"]]


async def test_pinned_session_sends_its_sampling_not_the_clients_and_records_the_clients(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(sampling={**TRAIN, "max_tokens": 64}, sampling_policy="pinned")
        await _oai(st, sid).chat.completions.create(
            model="m", messages=MSGS, temperature=0.0, top_p=0.5, max_tokens=20,
            presence_penalty=1.0, seed=99, extra_body={"top_k": 5, "min_p": 0.3})
        sent = (await st.engine_log())[-1]["sampling_params"]
        turn = (await _turns(st, sid))[0]
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"]) == (1.0, 1.0, -1, 0.0)
    assert "presence_penalty" not in sent and "sampling_seed" not in sent  # the session set neither
    assert sent["max_new_tokens"] == 20  # a budget below the session's is the client's to choose
    rec = turn["extra"]["sampling"]
    assert rec["policy"] == "pinned"
    assert rec["client"] == {"temperature": 0.0, "top_p": 0.5, "top_k": 5, "min_p": 0.3, "presence_penalty": 1.0,
                             "seed": 99, "max_tokens": 20}
    assert rec["engine"] == {**TRAIN, "max_tokens": 20}
    assert sorted(rec["overridden"]) == ["min_p", "presence_penalty", "seed", "temperature", "top_k", "top_p"]


async def test_pinned_caps_the_clients_budget_at_the_sessions(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(sampling={"max_tokens": 16}, sampling_policy="pinned")
        await _oai(st, sid).chat.completions.create(model="m", messages=MSGS, max_tokens=500)
        sent = (await st.engine_log())[-1]["sampling_params"]
        rec = (await _turns(st, sid))[0]["extra"]["sampling"]
    assert sent["max_new_tokens"] == 16
    assert rec["client"]["max_tokens"] == 500 and rec["engine"]["max_tokens"] == 16
    assert rec["overridden"] == ["max_tokens"]


async def test_client_policy_sends_the_clients_values_over_the_sessions(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(sampling={"temperature": 1.0, "top_p": 0.9, "max_tokens": 16}, sampling_policy="client")
        await _oai(st, sid).chat.completions.create(model="m", messages=MSGS, temperature=0.0, max_tokens=40)
        sent = (await st.engine_log())[-1]["sampling_params"]
        rec = (await _turns(st, sid))[0]["extra"]["sampling"]
    assert (sent["temperature"], sent["top_p"], sent["max_new_tokens"]) == (0.0, 0.9, 40)
    assert rec["policy"] == "client" and rec["overridden"] == []


async def test_server_default_is_pinned_and_a_sessions_choice_overrides_the_servers(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:  # no --sampling-policy: the default
        sid = await st.session(sampling={"temperature": 1.0})
        await st.chat(sid, {"messages": MSGS, "temperature": 0.0, "max_tokens": 16})
        assert (await st.engine_log())[-1]["sampling_params"]["temperature"] == 1.0
        assert (await st.http.get(f"/sessions/{sid}")).json()["sampling_policy"] == "pinned"
    async with live_stack(qwen3_dir, settings=Settings(sampling_policy="client")) as st:
        loose = await st.session(sampling={"temperature": 1.0})
        pinned = await st.session(sampling={"temperature": 1.0}, sampling_policy="pinned")
        for sid in (loose, pinned):
            await st.chat(sid, {"messages": MSGS, "temperature": 0.0, "max_tokens": 16})
        log = await st.engine_log()
        views = [(await st.http.get(f"/sessions/{s}")).json() for s in (loose, pinned)]
    assert [r["sampling_params"]["temperature"] for r in log] == [0.0, 1.0]
    assert [v["sampling_policy"] for v in views] == ["client", "pinned"]
    assert views[1]["sampling"] == {"temperature": 1.0}


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_responses_and_messages_dialects_obey_the_pinned_policy(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as st:
        rsid = await st.session(sampling={"temperature": 1.0, "top_p": 1.0}, sampling_policy="pinned")
        await _oai(st, rsid).responses.create(model="m", input="Fix the failing test.", temperature=0.0, top_p=0.2,
                                              max_output_tokens=24)
        asid = await st.session(sampling={"temperature": 1.0, "top_p": 1.0}, sampling_policy="pinned")
        ant = AsyncAnthropic(base_url=f"{st.url}/sessions/{asid}", api_key="x", max_retries=0)
        # this SDK (2.x) no longer types temperature / top_p / top_k; harnesses still send them
        await ant.messages.create(model="m", max_tokens=24, extra_body={"temperature": 0.0, "top_p": 0.2, "top_k": 3},
                                  messages=[{"role": "user", "content": "Fix the failing test."}])
        log = await st.engine_log()
        recs = [(await _turns(st, s))[0]["extra"]["sampling"] for s in (rsid, asid)]
    assert [(r["sampling_params"]["temperature"], r["sampling_params"]["top_p"]) for r in log] == [(1.0, 1.0)] * 2
    assert "top_k" not in log[1]["sampling_params"]
    assert recs[0]["client"] == {"temperature": 0.0, "top_p": 0.2, "max_tokens": 24}
    assert recs[1]["client"] == {"temperature": 0.0, "top_p": 0.2, "top_k": 3, "max_tokens": 24}


@pytest.mark.parametrize(("body", "field", "why"), [
    ({"sampling_policy": "loose"}, "sampling_policy", "'pinned' or 'client'"),
    ({"sampling_policy": 1}, "sampling_policy", "'pinned' or 'client'"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"seed": 1.5}, "seed", "valid integer"),
    ({"seed": "7"}, "seed", "valid integer"),
    ({"seed": True}, "seed", "valid integer"),
    ({"seed": 2**63}, "seed", "less than or equal to"),
    ({"seed": 1, "sampling": {"seed": 2}}, "seed", "exclusive"),
])
async def test_bad_sampling_policy_or_seed_is_a_400_naming_the_field(qwen3_dir: Path, body: dict[str, Any],
                                                                     field: str, why: str) -> None:
    async with live_stack(qwen3_dir) as st:
        r = await st.http.post("/sessions", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert field in message and why in message, message


def test_server_flag_refuses_an_unknown_sampling_policy() -> None:
    with pytest.raises(ValueError, match="sampling policy"):
        Settings(sampling_policy="loose")


async def test_session_view_and_samples_carry_the_policy_and_each_turns_sampling(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session(sampling={"temperature": 1.0}, sampling_policy="pinned", seed=5)
        await _oai(st, sid).chat.completions.create(model="m", messages=MSGS, temperature=0.2, max_tokens=16)
        view = (await st.http.get(f"/sessions/{sid}")).json()
        got = {fmt: await samples(st, sid, fmt) for fmt in ("json", "npz", "safetensors")}
    assert (view["sampling_policy"], view["seed"], view["sampling"]) == ("pinned", 5, {"temperature": 1.0})
    for fmt, each in got.items():
        s = each[0]
        assert s.metadata["sampling"] == {"policy": "pinned", "values": {"temperature": 1.0}, "seed": 5}, fmt
        turn = s.diagnostics[0]["sampling"]
        assert turn["client"]["temperature"] == 0.2 and turn["engine"]["temperature"] == 1.0, fmt
        assert len(turn["seeds"]) == 1, fmt
