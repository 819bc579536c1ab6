"""Through the live server: what is
rendered and stored, what is parsed, what the agent reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from session_server.ops.demo import TOOLS
from trajectory.codec import decode_text

from ..stack import live_stack
from ..trajectory.test_hardening_codec import EXACT, cleanup_tokenizer_dir

USER = {"role": "user", "content": "Fix the failing test."}


def _call(args: Any, cid: str = "call_1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "read_file", "arguments": args}}


def _assistant(args: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [_call(args)]}


def _tool_result() -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "call_1", "content": "def main(): ..."}


async def _last_prompt(st: Any) -> list[int]:
    return list((await st.engine_log())[-1]["input_ids"])


# -- decoding never alters text ----------------------------------------------------


async def test_turn_content_and_logprob_text_round_trip_exactly(tmp_path: Path) -> None:
    """A tokenizer configured to clean up spaces: the returned content, each logprob
    token's text and the streamed content are exactly what the ids say."""
    d = cleanup_tokenizer_dir(tmp_path)
    schema = {"const": EXACT}  # the simulator's constrained output is this JSON string
    body = {"messages": [USER], "max_tokens": 64, "logprobs": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    async with live_stack(d) as st:
        r = await st.chat(await st.session(), body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == f'"{EXACT}"'
        tokens = "".join(t["token"] for t in choice["logprobs"]["content"])
        assert tokens.startswith(f'"{EXACT}"')
        s = await st.chat(await st.session(), {**body, "stream": True})
        assert s.status_code == 200 and f'"{EXACT}"'.replace('"', '\\"') in s.text


# -- a client's own assistant tool call on turn 0 -------------------------------------


async def test_llama31_turn0_with_a_client_assistant_tool_call(tokenizer_dirs: dict[str, Path]) -> None:
    """Turn 0 carrying the client's own assistant tool call: rendered as sent (a 500 when
    the normal form, which has no `function` key, reached the template)."""
    msgs = [USER, _assistant('{"path": "setup.cfg"}'), _tool_result()]
    async with live_stack(tokenizer_dirs["llama3.1"]) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": msgs, "tools": TOOLS, "max_tokens": 32})
        assert r.status_code == 200, r.text
        traj = await st.trajectory(sid)
    assert traj["branches"][0]["messages"][: len(msgs)] == msgs  # stored as the client sent them


async def test_text_parts_rendered_joined_and_stored_as_sent(qwen3_dir: Path) -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "Fix the "}, {"type": "text", "text": "failing test."}]}
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        assert (await st.chat(sid, {"messages": [parts], "max_tokens": 16})).status_code == 200
        as_parts = await _last_prompt(st)
        traj = await st.trajectory(sid)
        assert (await st.chat(await st.session(), {"messages": [USER], "max_tokens": 16})).status_code == 200
        assert as_parts == await _last_prompt(st)  # the parts are joined as one string
    assert traj["branches"][0]["messages"][0] == parts


@pytest.mark.parametrize("kind", ["image_url", "input_audio"])
async def test_non_text_content_part_is_400_naming_its_type(qwen3_dir: Path, kind: str) -> None:
    msg = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": kind, kind: {"url": "x"}}]}
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": [msg], "max_tokens": 16})
        assert r.status_code == 400 and kind in r.json()["error"]["message"], r.text
        assert await st.engine_log() == []


@pytest.mark.parametrize("family", ["qwen3", "glm4moe"])
@pytest.mark.parametrize("args", ["not json", "[1, 2]", "3", '"a string"'])
async def test_tool_call_arguments_not_a_json_object_is_400(
    tokenizer_dirs: dict[str, Path], family: str, args: str
) -> None:
    async with live_stack(tokenizer_dirs[family]) as st:
        r = await st.chat(await st.session(), {"messages": [USER, _assistant(args), _tool_result()], "max_tokens": 16})
        assert r.status_code == 400, r.text
        assert "arguments" in r.json()["error"]["message"]


async def test_glm_gets_arguments_as_a_mapping(tokenizer_dirs: dict[str, Path]) -> None:
    """GLM iterates arguments as a mapping: a JSON string is handed over parsed."""
    async with live_stack(tokenizer_dirs["glm4moe"]) as st:
        msgs = [USER, _assistant('{"path": "README.md"}'), _tool_result()]
        r = await st.chat(await st.session(), {"messages": msgs, "tools": TOOLS, "max_tokens": 16})
        assert r.status_code == 200, r.text
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dirs["glm4moe"]))
        prompt = decode_text(tok, await _last_prompt(st))
    assert "<arg_key>path</arg_key>" in prompt and "<arg_value>README.md</arg_value>" in prompt


# -- the developer role is the system role ------------------------------------------


async def test_developer_is_system_on_turn_0_and_later(qwen3_dir: Path) -> None:
    dev = {"role": "developer", "content": "Answer in French."}
    sysm = {"role": "system", "content": "Answer in French."}
    async with live_stack(qwen3_dir) as st:
        a = await st.session()
        r = await st.chat(a, {"messages": [dev, USER], "max_tokens": 16})
        assert r.status_code == 200, r.text
        as_developer = await _last_prompt(st)
        assert (await st.chat(await st.session(), {"messages": [sysm, USER], "max_tokens": 16})).status_code == 200
        assert as_developer == await _last_prompt(st)
        # a later turn: the agent resends its developer message and adds another
        later = [dev, USER, r.json()["choices"][0]["message"], dev, {"role": "user", "content": "Go on."}]
        r2 = await st.chat(a, {"messages": later, "max_tokens": 16})
        assert r2.status_code == 200, r2.text
        view = (await st.http.get(f"/sessions/{a}")).json()
    assert len(view["branches"]) == 1 and view["turns"] == 2  # the resent developer message matched


# -- tools compared as the template renders them -------------------------------------


async def _two_turns(st: Any, sid: str, tools_0: Any, tools_1: Any) -> None:
    r = await st.chat(sid, {"messages": [USER], "tools": tools_0, "max_tokens": 64})
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    follow = [{"role": "tool", "tool_call_id": tc["id"], "content": "ok"} for tc in m.get("tool_calls") or []]
    nxt = [USER, m, *(follow or [{"role": "user", "content": "More."}])]
    r2 = await st.chat(sid, {"messages": nxt, "tools": tools_1, "max_tokens": 64})
    assert r2.status_code == 200, r2.text


async def test_a_change_of_tools_forks_with_a_diagnostic(qwen3_dir: Path) -> None:
    extra = {"type": "function", "function": {"name": "lint", "parameters": {"type": "object"}}}
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await _two_turns(st, sid, TOOLS, [*TOOLS, extra])
        view = (await st.http.get(f"/sessions/{sid}")).json()
    notes = [d for d in view["diagnostics"] if d["kind"] == "fork"]
    assert len(notes) == 1 and notes[0]["reason"] == "tools_changed" and notes[0]["turn"] == 1, view
    assert [b["reason"] for b in view["branches"]][-1] == "tools_changed"
    assert view["active_branch"] == view["branches"][-1]["id"] and view["turns"] == 1


async def test_tools_the_template_renders_identically_are_no_change(tokenizer_dirs: dict[str, Path]) -> None:
    """Plain Llama 3 renders no tools: sending other tools changes nothing it sees."""
    swapped = [{"function": {**t["function"]}, "type": "function"} for t in reversed(TOOLS)]
    async with live_stack(tokenizer_dirs["llama3"]) as st:
        sid = await st.session()
        await _two_turns(st, sid, TOOLS, swapped)
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert len(view["branches"]) == 1 and view["turns"] == 2 and view["diagnostics"] == []


async def test_same_tools_resent_is_no_change(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        await _two_turns(st, sid, TOOLS, [dict(t) for t in TOOLS])
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert len(view["branches"]) == 1 and view["turns"] == 2


# -- tool markup without offered tools is content -----------------------------------


async def test_no_tools_sent_means_tool_markup_is_content(qwen3_dir: Path) -> None:
    """A model that writes tool-call markup though the request sent no `tools` (the
    simulated one, scripted to: unscripted it calls only offered tools): the text is
    content and the turn finishes `stop`."""
    async with live_stack(qwen3_dir) as st:
        with_tools = (await st.chat(await st.session(), {"messages": [USER], "tools": TOOLS, "max_tokens": 128})).json()
        assert with_tools["choices"][0]["message"].get("tool_calls")
        sid = await st.session()
        script = {"turns": [{"tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}}]}], "session": sid}
        assert (await st.http.post(f"{st.engines[0]}/sim/script", json=script)).status_code == 200
        r = await st.chat(sid, {"messages": [USER], "max_tokens": 128})
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert "<tool_call>" in choice["message"]["content"]


# -- a streamed tool-only turn keeps its logprobs -----------------------------------


async def test_streamed_tool_only_turn_carries_its_logprobs(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": [USER], "tools": TOOLS, "max_tokens": 128, "logprobs": True, "stream": True})
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        traj = await st.trajectory(sid)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == ""  # a tool-only turn
    lps = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    turn = traj["branches"][0]["turns"][0]
    assert len(lps) == turn["output_end"] - turn["output_start"] > 0


@pytest.mark.parametrize("role", [["user"], {"r": 1}, 3, None])
def test_a_role_that_is_not_a_string_is_400_not_500(role: Any) -> None:
    """Found by the fuzz test: a list role was a TypeError (unhashable) inside validation."""
    from session_server.api.models import parse_json_model
    from session_server.errors import BadRequest
    from session_server.turn.chat_request import ChatRequest

    body = json.dumps({"messages": [{"role": role, "content": "hi"}]}).encode()
    with pytest.raises(BadRequest, match="role must be one of"):
        parse_json_model(body, ChatRequest)
