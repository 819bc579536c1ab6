"""Strict types at the edge: a value of the wrong JSON type is a 400 naming the field, in
the route's own error shape, on every dialect that has the field; never a 200 with a
guess (pydantic's lax mode read `"yes"` as true, `false` as 0.0; a template read
`enable_thinking: "no"` as truthy: thinking stayed on).

Types are the SDKs' (openai 3.x `types/chat/completion_create_params.py`,
`shared_params/function_definition.py`, `types/responses/function_tool_param.py`;
anthropic `types/message_create_params.py`, `tool_param.py`, `tool_result_block_param.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from session_server.app import AppConfig, create_app
from session_server.context import Settings

USER = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"messages": USER}
RESP: dict[str, Any] = {"input": "hi"}
ANTH: dict[str, Any] = {"max_tokens": 8, "messages": USER}
ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
BASES = {"chat": CHAT, "responses": RESP, "messages": ANTH}

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (dialect, field named in the message, the body's bad part)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    # a reasoning switch of the wrong type: Jinja truthiness would turn "no" into thinking ON
    ("chat", "enable_thinking", {"chat_template_kwargs": {"enable_thinking": "no"}}),
    ("responses", "enable_thinking", {"chat_template_kwargs": {"enable_thinking": "no"}}),
    ("messages", "enable_thinking", {"chat_template_kwargs": {"enable_thinking": "no"}}),
    ("chat", "thinking", {"chat_template_kwargs": {"thinking": 0}}),
    ("chat", "reasoning_effort", {"chat_template_kwargs": {"reasoning_effort": 3}}),
    # apply_chat_template's own arguments are the server's, not template variables
    ("chat", "sanitize_control_tokens", {"chat_template_kwargs": {"sanitize_control_tokens": True}}),
    ("chat", "conversations", {"chat_template_kwargs": {"conversations": []}}),
    ("chat", "stream", {"stream": "yes"}),
    ("responses", "stream", {"stream": "yes"}),
    ("messages", "stream", {"stream": "yes"}),
    ("chat", "logprobs", {"logprobs": "yes"}),
    ("chat", "tools[0].function", {"tools": [{}]}),
    ("responses", "tools[0].type", {"tools": [{}]}),
    ("messages", "tools[0].name", {"tools": [{}]}),
    ("chat", "tools[0].function.name", {"tools": [{"type": "function", "function": {"parameters": {}}}]}),
    ("chat", "tools[0].function.name", {"tools": [{"type": "function", "function": {"name": 5}}]}),
    ("responses", "tools[0].name", {"tools": [{"type": "function", "parameters": {}}]}),
    ("messages", "tools[0].name", {"tools": [{"input_schema": {"type": "object"}}]}),
    ("chat", "tools[0].function.parameters",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
    ("responses", "tools[0].parameters", {"tools": [{"type": "function", "name": "f", "parameters": "x"}]}),
    ("messages", "tools[0].input_schema", {"tools": [{"name": "f", "input_schema": "x"}]}),
    ("messages", "tools[0].description", {"tools": [{"name": "f", "input_schema": {}, "description": 5}]}),
    ("chat", "seed", {"seed": -1}),
    ("responses", "seed", {"seed": -1}),
    ("chat", "tool_call_id", {"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": 5, "content": "r"}]}),
    ("responses", "call_id", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                        {"type": "function_call_output", "call_id": 5, "output": "r"}]}),
    ("messages", "tool_use_id", {"messages": [
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5, "content": "r"}]}]}),
    ("chat", "frequency_penalty", {"frequency_penalty": False}),
    ("responses", "frequency_penalty", {"frequency_penalty": False}),
    ("chat", "temperature", {"temperature": "0.5"}),
    ("responses", "temperature", {"temperature": "0.5"}),
    ("messages", "temperature", {"temperature": "0.5"}),
    ("messages", "top_p", {"top_p": True}),
    ("responses", "max_output_tokens", {"max_output_tokens": "5"}),
    ("responses", "store", {"store": "yes"}),
    ("chat", "n", {"n": True}),
    ("chat", "timeout_s", {"timeout_s": "5"}),
]

SESSION_CASES: list[tuple[str, dict[str, Any]]] = [
    ("sampling.frequency_penalty", {"sampling": {"frequency_penalty": False}}),
    ("sampling.seed", {"sampling": {"seed": -1}}),
    ("sampling.temperature", {"sampling": {"temperature": "1"}}),
    ("enable_thinking", {"chat_template_kwargs": {"enable_thinking": "no"}}),
    ("lora", {"lora": ""}),
    ("ttl_s", {"ttl_s": "60"}),
]


@pytest.fixture(scope="module")
def client(tokenizer_dirs: dict[str, Path]) -> Iterator[TestClient]:
    app = create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]),
                               settings=Settings(cpu_workers=1, decode_processes=0)))
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize(("dialect", "field", "bad"), CASES,
                         ids=[f"{d}-{f}-{i}" for i, (d, f, _) in enumerate(CASES)])
def test_a_wrong_type_is_a_400_naming_the_field_in_the_dialects_error_shape(
    client: TestClient, dialect: str, field: str, bad: dict[str, Any],
) -> None:
    sid = client.post("/sessions", json={}).json()["session_id"]
    r = client.post(f"/sessions/{sid}{ROUTES[dialect]}", json={**BASES[dialect], **bad})
    assert r.status_code == 400, r.text
    body = r.json()
    if dialect == "messages":  # Anthropic's shape on its routes
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["type"] == "invalid_request", body
    assert field in body["error"]["message"], body
    assert client.get(f"/sessions/{sid}").json()["turns"] == 0  # nothing ran


@pytest.mark.parametrize(("field", "bad"), SESSION_CASES, ids=[f for f, _ in SESSION_CASES])
def test_a_wrong_type_in_the_session_config_is_a_400_naming_the_field(
    client: TestClient, field: str, bad: dict[str, Any],
) -> None:
    r = client.post("/sessions", json=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request" and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("spec", ["http://a b:80", "http://a:80/x y", " http://a:80", "http://a\t:80",
                                  "sglang=http://a:80\n"])
def test_an_engine_url_with_whitespace_is_a_400_naming_it(client: TestClient, spec: str) -> None:
    r = client.post("/engines", json={"url": spec})
    assert r.status_code == 400, r.text
    assert "url" in r.json()["error"]["message"] and repr(spec) in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["/control/pause", "/control/resume"])
def test_an_empty_lora_name_is_a_400(client: TestClient, path: str) -> None:
    r = client.post(path, json={"lora": ""})
    assert r.status_code == 400 and "lora" in r.json()["error"]["message"], r.text
