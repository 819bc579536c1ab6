"""The simulated model calls the tools the request offers, read as an engine reads them
(from the rendered prompt), answers in plain text when none is offered, and a script set
for one session is played by that session alone (an engine-wide one says so)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from session_server.sim.offered import arguments_for, offered_tools

from ..stack import live_stack

USER = {"role": "user", "content": "What is the weather in Paris?"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days", "unit"]}}}
BASH = {"type": "function", "function": {
    "name": "Bash", "description": "Run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                   "required": ["command"]}}}


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "glm4moe"])
def test_the_tools_a_template_renders_are_read_back_from_the_prompt(family: str,
                                                                   tokenizer_dirs: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dirs[family]))
    text = tok.apply_chat_template([USER], tools=[WEATHER, BASH], add_generation_prompt=True, tokenize=False)
    tools = offered_tools(text)
    assert [name for name, _ in tools] == ["get_weather", "Bash"], text
    args = arguments_for(dict(tools[0][1]), 12345)
    assert set(args) == {"city", "days", "unit"} and isinstance(args["city"], str)
    assert isinstance(args["days"], int) and args["unit"] in ("c", "f")
    assert set(arguments_for(dict(tools[1][1]), 7)) == {"command"}  # required parameters only
    assert offered_tools(tok.apply_chat_template([USER], add_generation_prompt=True, tokenize=False)) == ()


def _calls(reply: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    msg = reply["choices"][0]["message"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]


async def test_the_simulated_model_calls_the_offered_tools_and_answers_in_text_without_any(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        seen: set[str] = set()
        for k in range(6):  # a few episodes: each plans 1-3 tool turns first
            user = {"role": "user", "content": f"Task {k}: check the weather."}
            r = await st.chat(await st.session(), {"model": "m", "messages": [user], "tools": [WEATHER, BASH],
                                                   "max_tokens": 256})
            assert r.status_code == 200, r.text
            calls = _calls(r.json())
            assert calls and "<tool_call>" not in (r.json()["choices"][0]["message"]["content"] or ""), r.json()
            for name, args in calls:
                assert name in ("get_weather", "Bash")
                assert set(args) == ({"city", "days", "unit"} if name == "get_weather" else {"command"})
                seen.add(name)
            r = await st.chat(await st.session(), {"model": "m", "messages": [user], "max_tokens": 256})
            plain = r.json()["choices"][0]["message"]
            assert not plain.get("tool_calls") and plain["content"].startswith("Done:"), plain
        assert seen == {"get_weather", "Bash"}


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_session_script_is_played_by_that_session_only_and_engines_never_see_the_id(
        qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as st, httpx.AsyncClient() as c:
        scripted, other = await st.session(), await st.session()
        r = await c.post(f"{st.engines[0]}/sim/script", json={"turns": [{"content": "Scripted."}], "session": scripted})
        assert r.status_code == 200 and r.json()["scope"] == "session", r.text
        body = {"model": "m", "messages": [USER], "max_tokens": 64}
        assert (await st.chat(scripted, body)).json()["choices"][0]["message"]["content"] == "Scripted."
        assert (await st.chat(other, body)).json()["choices"][0]["message"]["content"] != "Scripted."
        # the engine is told the session's digest, never its id (a capability when auth is off)
        tags = [entry["session"] for entry in await st.engine_log()]
        assert len(tags) == 2 and len(set(tags)) == 2 and all(isinstance(t, str) and len(t) == 32 for t in tags)
        assert not {scripted, other} & set(tags) and not any(scripted in t or other in t for t in tags), tags
        # without a session the script is engine-wide, and the answer says so
        r = await c.post(f"{st.engines[0]}/sim/script", json={"turns": [{"content": "Everyone."}]})
        assert r.json()["scope"] == "engine" and "engine-wide" in r.json()["warning"]
        third = await st.session()
        assert (await st.chat(third, body)).json()["choices"][0]["message"]["content"] == "Everyone."
        # the session's own script still wins over the engine-wide one
        again = {"model": "m", "messages": [{"role": "user", "content": "Again."}], "max_tokens": 64}
        assert (await st.chat(scripted, again)).json()["choices"][0]["message"]["content"] == "Scripted."
        bad = await c.post(f"{st.engines[0]}/sim/script", json={"turns": [], "session": 3})
        assert bad.status_code == 400


def test_a_partial_resubmitted_under_another_seed_continues_only_its_own_sessions_plan() -> None:
    """A resubmitted partial continues the plan it was drawn from (sampler module doc);
    that plan is looked up among the request's own script owner's plans: another
    session's script, cached for the same prefix, never answers it."""
    import numpy as np

    from session_server.sim import ScriptedPolicy
    from session_server.sim.toy import TOY_EOT, toy_model, toy_prompt

    prompt = toy_prompt(("user", "list the files"))
    p = ScriptedPolicy(toy_model(), seed=0)
    p.set_script([{"content": "Only session A says this."}], session="A")
    a = p.start(prompt, seed=1, session="A").planned
    b = p.start(prompt, seed=1, session="B").planned
    k = next(i for i in range(len(a)) if i >= len(b) or a[i] != b[i]) + 1  # a head of A's plan only
    # B resubmits A's head under another seed: not its plan, so its turn closes
    c = p.start([*prompt, *a[:k]], seed=2, session="B")
    assert c.diverged and c.token(0) == TOY_EOT
    # A itself does continue its own plan under another seed, and B its own
    assert p.start([*prompt, *a[:k]], seed=2, session="A").token(0) == a[k]
    kb = max(1, len(b) // 2)
    cb = p.start([*prompt, *b[:kb]], seed=2, session="B")
    assert not cb.diverged and np.array_equal([cb.token(i) for i in range(len(b) - kb)], b[kb:])
