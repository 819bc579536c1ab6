"""Findings of the second review: each pinned by a test named after it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ..stack import live_stack

MSG = [{"role": "user", "content": "Fix the failing test."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 12}, "count": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "minLength": 3}, "minItems": 3}},
    "required": ["title", "count", "tags"],
}
RF = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_constrained_turn_aborted_midway_commits_the_uninterrupted_instance(
    qwen3_dir: Path, protocol: str
) -> None:
    """An engine restarts the grammar at the first output token: resubmitting `prompt +
    partial` under the same constraint would commit the partial followed by a whole new
    instance. The partial is dropped and the turn regenerated from its own prompt."""
    async with live_stack(qwen3_dir, protocol) as stack:
        plain = await stack.session()
        r0 = await stack.chat(plain, {"messages": MSG, "max_tokens": 200, "response_format": RF})
        assert r0.status_code == 200, r0.text
        expected = r0.json()["choices"][0]["message"]["content"]

        sid = await stack.session()
        await stack.fault("abort_midway")
        r = await stack.chat(sid, {"messages": MSG, "max_tokens": 200, "response_format": RF})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert json.loads(content) == json.loads(expected)
        assert content == expected

        log = await stack.engine_log()
        aborted, resubmitted = log[-2], log[-1]
        assert aborted["finish_reason"] == "abort" and aborted["output_ids"]
        # the resubmission carries the original prompt, not prompt + partial
        assert resubmitted["input_ids"] == aborted["input_ids"]
        traj = await stack.trajectory(sid)
        branch = traj["branches"][-1] if "branches" in traj else traj
        sampled = [t for t, m in zip(branch["token_ids"], branch["loss_mask"], strict=True) if m]
        assert sampled == resubmitted["output_ids"]
        view = (await stack.http.get(f"/sessions/{sid}")).json()
        assert view["control"]["dropped_tokens"] == len(aborted["output_ids"])


TOOL = {"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}


def _tool(params: Any, name: str = "run") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


@pytest.mark.parametrize("params", [
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
    {"type": "object", "properties": {"a": {"enum": "xy"}}},
    {"type": "object", "properties": {"a": {"enum": []}}},
    {"type": "object", "properties": {"a": {"anyOf": []}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": ["A"]},
    {"type": "object", "properties": {"a": {"$ref": 7}}},
    {"type": "object", "properties": {"a": {"type": "strnig"}}},
    {"type": "object", "properties": ["a"]},
    {"type": "object", "properties": {"a": False}},
    {"type": "object", "properties": {"a": "string"}},
])
async def test_malformed_tool_parameters_under_forced_tool_choice_are_400(
    qwen3_dir: Path, params: dict[str, Any]
) -> None:
    """Malformed parameter schemas (non-list required/enum, empty enum/anyOf, non-object
    $defs, unknown types) never reach the engine as a broken grammar nor raise a 500."""
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        r = await stack.chat(sid, {"messages": MSG, "tools": [_tool(params)], "tool_choice": "required",
                                   "max_tokens": 50})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("tool_choice")
        assert await stack.engine_log() == []


def _deep(n: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    return node


async def test_deep_schemas_and_long_ref_chains_are_400_not_500(qwen3_dir: Path) -> None:
    """Deep response_format schemas and $ref chains longer than the bound answer 400."""
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        rf = {"type": "json_schema", "json_schema": {"name": "d", "schema": _deep(400)}}
        r = await stack.chat(sid, {"messages": MSG, "max_tokens": 20, "response_format": rf})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("response_format")
        defs = {f"D{i}": {"$ref": f"#/$defs/D{i + 1}"} for i in range(200)}
        defs["D200"] = {"type": "string"}
        params = {"type": "object", "properties": {"a": {"$ref": "#/$defs/D0"}}, "$defs": defs}
        r = await stack.chat(sid, {"messages": MSG, "tools": [_tool(params)], "tool_choice": "required",
                                   "max_tokens": 20})
        assert r.status_code == 400, r.text
        assert "deeper" in r.json()["error"]["message"]
        r = await stack.chat(sid, {"messages": MSG, "tools": [_tool(_deep(60))], "tool_choice": "required",
                                   "max_tokens": 20})
        assert r.status_code == 400, r.text
        assert await stack.engine_log() == []


async def test_constraint_is_derived_off_the_event_loop(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large request's constraint (work proportional to its schemas) is built on the offload threads."""
    import asyncio

    import session_server.turn.prepare as prepare

    on_loop: list[bool] = []
    real = prepare.request_constraint

    def spy(req: Any, family: str) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(req, family)

    monkeypatch.setattr(prepare, "request_constraint", spy)
    props = {f"field_{i}": {"type": "string", "description": "x" * 40} for i in range(400)}
    params = {"type": "object", "properties": props, "required": ["field_0"]}
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        r = await stack.chat(sid, {"messages": MSG, "tools": [_tool(params)], "tool_choice": "required",
                                   "max_tokens": 400})
        assert r.status_code in (200, 502), r.text
    assert on_loop == [False]


def test_defs_of_two_tools_do_not_collide_and_nested_refs_resolve() -> None:
    from session_server.sim.constrained import ebnf_shortest
    from session_server.structured import hermes_tool_call_ebnf

    a = {"type": "object", "properties": {"v": {"$ref": "#/$defs/Item"}}, "required": ["v"],
         "$defs": {"Item": {"type": "integer", "const": 1}}}
    b = {"type": "object", "properties": {"v": {"$ref": "#/$defs/Item"},
                                           "w": {"$ref": "#/$defs/Box/properties/inner"}},
         "required": ["v", "w"],
         "$defs": {"Item": {"const": "two"}, "Box": {"type": "object", "properties": {"inner": {"const": [3]}}}}}
    grammar = hermes_tool_call_ebnf([("a", a), ("b", b)])
    text = ebnf_shortest(grammar)
    call_a = json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
    assert call_a == {"name": "a", "arguments": {"v": 1}}
    only_b = hermes_tool_call_ebnf([("b", b)])
    call_b = json.loads(ebnf_shortest(only_b).split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
    assert call_b == {"name": "b", "arguments": {"v": "two", "w": [3]}}
    # tool a's Item is still the integer when both tools share one grammar
    assert '"1"' in grammar and '"\\"two\\""' in grammar


def test_all_optional_objects_allow_any_subset_and_strings_follow_json() -> None:
    """Any ordered subset of optional keys (not only those after the first); strings
    refuse raw control characters and accept \\uXXXX escapes."""
    from session_server.structured import schema_to_ebnf

    lark = pytest.importorskip("lark")  # a general CFG parser stands in for xgrammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                               "c": {"type": "boolean"}}}
    parser = lark.Lark(_gbnf_to_lark(schema_to_ebnf(schema)), start="root", parser="earley")
    for ok in ['{}', '{"a": 1}', '{"b": "x"}', '{"c": true}', '{"b": "x", "c": false}',
               '{"a": 1, "c": true}', '{"a": 1, "b": "\\u00e9", "c": true}']:
        parser.parse(ok)
    for bad in ['{"b": "x", "a": 1}', '{"b": "a\nb"}', '{,"b": "x"}', '{"a": 1,}']:
        with pytest.raises(lark.exceptions.LarkError):
            parser.parse(bad)


def _gbnf_to_lark(grammar: str) -> str:
    """Translate our GBNF subset to lark's EBNF (rules lower-case, literals and classes kept)."""
    import re

    out = []
    for line in grammar.splitlines():
        if not line.strip():
            continue
        name, body = line.split("::=", 1)
        body = re.sub(r"\[([^\]]*)\]", lambda m: "/[" + m.group(1).replace("/", "\\/") + "]/", body)
        out.append(f"{name.strip()}: {body.strip()}")
    return "\n".join(out)


async def test_force_reset_weight_version_keeps_existing_sessions_working(qwen3_dir: Path) -> None:
    """After `force` resets the version backwards, a session committed at the old, higher
    version still gets 200 (its old version is no longer the floor)."""
    import httpx

    async with live_stack(qwen3_dir, "sglang") as stack:
        async with httpx.AsyncClient() as sim:
            await sim.post(f"{stack.engines[0]}/sim/weight_version", json={"version": 5})
            assert (await stack.http.post("/control/weight_version", json={"version": 5})).status_code == 200
            sid = await stack.session()
            r = await stack.chat(sid, {"messages": MSG, "max_tokens": 30})
            assert r.status_code == 200, r.text
            await sim.post(f"{stack.engines[0]}/sim/weight_version", json={"version": 1})
            reset = await stack.http.post("/control/weight_version", json={"version": 1, "force": True})
            assert reset.status_code == 200, reset.text
        reply = r.json()["choices"][0]["message"]
        turn2 = [*MSG, {"role": "assistant", "content": reply["content"] or ""},
                 {"role": "user", "content": "go on"}]
        r2 = await stack.chat(sid, {"messages": turn2, "max_tokens": 30})
        assert r2.status_code == 200, r2.text
        traj = await stack.trajectory(sid)
        branch = traj["branches"][-1] if "branches" in traj else traj
        versions = [span[2] for t in branch["turns"] for span in (t.get("weight_spans") or [])] or [
            t.get("weight_version") for t in branch["turns"]]
        assert [str(v) for v in versions] == ["5", "1"]


async def test_rehome_keeps_the_turn_deadline(qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn re-homed after its engine died keeps the deadline it started with."""
    import asyncio

    import session_server.turn.dispatch as dispatch
    from session_server.errors import UpstreamTransportError

    deadlines: list[float | None] = []
    real = dispatch.generate_resilient

    async def flaky(adapter: Any, request: Any, control: Any, **kw: Any) -> Any:
        deadlines.append(kw.get("deadline"))
        if len(deadlines) == 1:
            await asyncio.sleep(0.2)
            raise UpstreamTransportError("connection reset", engine="x", transient=False)
        return await real(adapter, request, control, **kw)

    monkeypatch.setattr(dispatch, "generate_resilient", flaky)
    monkeypatch.setattr(dispatch, "record_failure", lambda *a, **k: True)  # the first engine is dead
    async with live_stack(qwen3_dir, "sglang", n_engines=2) as stack:
        sid = await stack.session()
        r = await stack.chat(sid, {"messages": MSG, "max_tokens": 30})
        assert r.status_code == 200, r.text
    assert len(deadlines) == 2 and deadlines[0] is not None and deadlines[0] == deadlines[1]


def test_engine_refusal_blames_the_constraint_only_for_grammar_errors() -> None:
    from session_server.errors import UpstreamHTTPError
    from session_server.structured import Constraint, engine_refusal

    class Req:
        response_format = {"type": "json_schema"}

    c = Constraint("json_schema", "{}")
    grammar = UpstreamHTTPError("Invalid grammar request: unresolvable $ref", engine="e", http_status=400)
    other = UpstreamHTTPError("The input (40000 tokens) is longer than the model's context", engine="e",
                              http_status=400)
    assert engine_refusal(grammar, c, Req()) is not None
    assert engine_refusal(other, c, Req()) is None
    assert engine_refusal(grammar, None, Req()) is None


async def test_constrained_turn_aborted_over_and_over_without_a_pause_is_503(qwen3_dir: Path) -> None:
    """A dropped constrained partial leaves the budget whole, so aborts that no pause
    explains are bounded like empty ones: 503 engine_aborted, nothing committed."""
    async with live_stack(qwen3_dir, "sglang") as stack:
        sid = await stack.session()
        await stack.fault("abort_midway", count=40)
        r = await stack.chat(sid, {"messages": MSG, "max_tokens": 200, "response_format": RF})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "engine_aborted"
        assert r.headers["retry-after"] == "1"
        assert len(await stack.engine_log()) == 9  # max_empty_aborts (8) + 1, then it gives up
        traj = await stack.trajectory(sid)
        branches = traj.get("branches", [traj])
        assert all(not b["turns"] for b in branches)
