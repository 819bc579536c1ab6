"""`tool_choice` and `response_format` are honoured with constrained decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from session_server.sim.constrained import ebnf_shortest
from session_server.structured import hermes_tool_call_ebnf, schema_to_ebnf

from ..stack import live_stack

pytestmark = pytest.mark.asyncio

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "mode": {"enum": ["fast", "safe"]}},
        "required": ["command", "mode"]}}},
]
MSG = [{"role": "user", "content": "Fix the failing test."}]


class Answer(BaseModel):
    title: str
    count: int
    tags: list[str]
    ok: bool


def _constraint_sent(entry: dict[str, Any], protocol: str) -> dict[str, Any]:
    sp = entry["sampling_params"]
    if protocol == "sglang":
        return {k: sp[k] for k in ("json_schema", "regex", "ebnf") if k in sp}
    return dict(sp.get("structured_outputs") or {})


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_response_format_json_schema_parse_returns_object(qwen3_dir: Path, protocol: str) -> None:
    """The openai SDK's `.parse()` with a pydantic model gets a parsed object; the engine got the schema."""
    openai = pytest.importorskip("openai")
    async with live_stack(qwen3_dir, protocol) as stack:
        sid = await stack.session()
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x")
        done = await client.chat.completions.parse(
            model="m", messages=MSG, response_format=Answer, max_tokens=200
        )
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Answer)
        log = await stack.engine_log()
        sent = _constraint_sent(log[-1], protocol)
        key = "json_schema" if protocol == "sglang" else "json"
        assert json.loads(sent[key])["properties"].keys() == Answer.model_json_schema()["properties"].keys()
        traj = await stack.trajectory(sid)
        branch = traj["branches"][-1] if "branches" in traj else traj
        assert log[-1]["output_ids"] == [t for t, m in zip(branch["token_ids"], branch["loss_mask"], strict=True) if m]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_tool_choice_named_returns_that_tool_call(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as stack:
        sid = await stack.session()
        choice = {"type": "function", "function": {"name": "run_shell"}}
        r = await stack.chat(sid, {"messages": MSG, "tools": TOOLS, "tool_choice": choice, "max_tokens": 200})
        assert r.status_code == 200, r.text
        body = r.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls"
        (call,) = body["message"]["tool_calls"]
        assert call["function"]["name"] == "run_shell"
        args = json.loads(call["function"]["arguments"])
        assert set(args) >= {"command", "mode"} and args["mode"] in ("fast", "safe")
        sent = _constraint_sent((await stack.engine_log())[-1], protocol)
        grammar = sent["ebnf" if protocol == "sglang" else "grammar"]
        assert '"\\"run_shell\\""' in grammar and "read_file" not in grammar


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_tool_choice_required_returns_a_tool_call(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as stack:
        sid = await stack.session()
        # the scripted sim model would answer in content on this turn without the constraint
        r = await stack.chat(sid, {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200})
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] in ("read_file", "run_shell")
        sent = _constraint_sent((await stack.engine_log())[-1], protocol)
        grammar = sent["ebnf" if protocol == "sglang" else "grammar"]
        assert "read_file" in grammar and "run_shell" in grammar


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_tool_choice_none_returns_content(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as stack:
        sid = await stack.session()
        r = await stack.chat(sid, {"messages": MSG, "tools": TOOLS, "tool_choice": "none", "max_tokens": 300})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert not msg.get("tool_calls")
        assert r.json()["choices"][0]["finish_reason"] != "tool_calls"
        # the scripted sim model calls a tool on every first turn: with auto it is a call,
        # with none the same markup is content
        sid2 = await stack.session()
        r2 = await stack.chat(sid2, {"messages": MSG, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 300})
        assert r2.json()["choices"][0]["message"].get("tool_calls")
        assert "<tool_call>" in (msg["content"] or "")


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_tool_choice_with_response_format_is_400_naming_fields(qwen3_dir: Path, protocol: str) -> None:
    async with live_stack(qwen3_dir, protocol) as stack:
        sid = await stack.session()
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 50,
                "response_format": {"type": "json_object"}}
        r = await stack.chat(sid, body)
        assert r.status_code == 400
        assert "response_format" in r.json()["error"]["message"] and "tool_choice" in r.json()["error"]["message"]
        r = await stack.chat(sid, {"messages": MSG, "tools": TOOLS, "max_tokens": 50,
                                   "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]
        r = await stack.chat(sid, {"messages": MSG, "max_tokens": 50, "response_format": {"type": "yaml"}})
        assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
        assert await stack.engine_log() == []


async def test_engine_refusing_the_constraint_is_400_naming_the_field(qwen3_dir: Path) -> None:
    """An engine 4xx on a constraint (here: an unresolvable $ref) is a 400 naming response_format."""
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/Missing"}}}
        r = await stack.chat(sid, {"messages": MSG, "max_tokens": 50, "response_format": rf})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("response_format")


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_tool_call_grammar_shortest_instance_parses_as_the_tool() -> None:
    grammar = hermes_tool_call_ebnf([("run_shell", TOOLS[1]["function"]["parameters"])])
    text = ebnf_shortest(grammar)
    body = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert body == {"name": "run_shell", "arguments": {"command": "", "mode": "fast"}}
    assert json.loads(ebnf_shortest(schema_to_ebnf(Answer.model_json_schema()))) == {
        "title": "", "count": 0, "tags": [], "ok": True
    }


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_forced_tool_call_missing_is_502_unless_cut_short() -> None:
    """An engine that ignores the grammar (no call under tool_choice required) is a 502
    with nothing committed; a call cut by the token budget is not the engine's fault."""
    from types import SimpleNamespace

    import numpy as np

    from session_server.errors import UpstreamInvalid
    from session_server.structured import apply_output_policy
    from session_server.turn.chat_request import ChatRequest
    from trajectory.codec.base import ParsedAssistant

    req = ChatRequest(messages=MSG, tools=TOOLS, tool_choice="required")
    parsed = ParsedAssistant(content="no call", reasoning_content=None)
    with pytest.raises(UpstreamInvalid):
        apply_output_policy(parsed, req, None, SimpleNamespace(ids=np.array([1]), finish_reason="stop"))
    assert apply_output_policy(parsed, req, None, SimpleNamespace(ids=np.array([1]), finish_reason="length")) is parsed


def _tool_call_parser(single: bool) -> Any:
    from tests.fast.e2e.test_review_findings import _gbnf_to_lark

    lark = pytest.importorskip("lark")  # a general CFG parser stands in for the engines' backends
    params = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"]}
    grammar = hermes_tool_call_ebnf([("get_weather", params)], single=single)
    return lark, lark.Lark(_gbnf_to_lark(grammar), start="root", parser="earley")


def test_parallel_tool_calls_false_allows_exactly_one_call() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    lark, one = _tool_call_parser(single=True)
    _, many = _tool_call_parser(single=False)
    one.parse(call)
    many.parse(call + "\n" + call)
    with pytest.raises(lark.exceptions.LarkError):
        one.parse(call + "\n" + call)


def test_whitespace_between_json_tokens_is_bounded() -> None:
    """A model that prefers whitespace cannot fill the turn with it (seen with random
    weights under vLLM's grammar backend): 16 characters per gap, no more."""
    lark, parser = _tool_call_parser(single=True)
    for n in (0, 1, 16):
        parser.parse('<tool_call>{"name":' + " " * n + '"get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    with pytest.raises(lark.exceptions.LarkError):
        parser.parse('<tool_call>{"name":' + " " * 17 + '"get_weather", "arguments": {"city": "Paris"}}</tool_call>')


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_parallel_tool_calls_false_reaches_the_engine_grammar(qwen3_dir: Path, protocol: str) -> None:
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    async with live_stack(qwen3_dir, protocol) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": [{"role": "user", "content": "Read it."}], "tools": tools,
                                "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 128})
        assert r.status_code == 200, r.text
        import httpx

        async with httpx.AsyncClient() as c:
            sent = (await c.get(f"{st.engines[0]}/sim/requests")).json()[-1]["sampling_params"]
        grammar = sent["ebnf"] if protocol == "sglang" else sent["structured_outputs"]["grammar"]
        assert grammar.splitlines()[0] == "root ::= think? ws call"
        bad = await st.chat(sid, {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "no"})
        assert bad.status_code == 400 and "parallel_tool_calls" in bad.text
