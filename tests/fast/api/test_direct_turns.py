"""The turn routes served outside FastAPI's routing answer exactly as FastAPI's routing
would, errors and their shapes included, and never pass through Starlette's router."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from session_server.api.direct import DirectTurns, direct_route
from session_server.api.turn_endpoint import TurnEndpoint
from session_server.app import AppConfig, create_app
from session_server.context import Settings

TURN_PATHS = ("chat/completions", "messages", "messages/count_tokens", "responses")


def _app(tokenizer_dir: Path, *, direct: bool) -> FastAPI:
    app = create_app(AppConfig(tokenizer=str(tokenizer_dir),
                               settings=Settings(cpu_workers=1, decode_processes=0, max_body_bytes=4096)))
    if not direct:  # the same app with every turn route left to FastAPI's routing
        app.user_middleware = [m for m in app.user_middleware if m.cls is not DirectTurns]
    return app


@pytest.fixture(scope="module")
def clients(tokenizer_dirs: dict[str, Path]) -> Iterator[tuple[TestClient, TestClient]]:
    with TestClient(_app(tokenizer_dirs["qwen3"], direct=True)) as a, \
            TestClient(_app(tokenizer_dirs["qwen3"], direct=False)) as b:
        yield a, b


def _answer(client: TestClient, method: str, path: str, **kw: Any) -> tuple[int, dict[str, str], Any]:
    r = client.request(method, path, **kw)
    keep = {k: v for k, v in r.headers.items() if k in ("content-type", "allow", "retry-after", "x-should-retry")}
    return r.status_code, keep, r.json() if r.content else None


def _session(client: TestClient) -> str:
    r = client.post("/sessions", json={})
    assert r.status_code == 201, r.text
    sid: str = r.json()["session_id"]
    return sid


@pytest.mark.parametrize("suffix", TURN_PATHS)
def test_a_turn_routes_errors_are_the_same_with_and_without_the_direct_path(
        clients: tuple[TestClient, TestClient], suffix: str) -> None:
    direct, routed = clients
    sid_d, sid_r = _session(direct), _session(routed)
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/sessions/{sid}/v1/" + suffix, {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("POST", "/sessions/{sid}/v1/" + suffix, {"json": {"messages": "no"}}),
        ("POST", "/sessions/{sid}/v1/" + suffix, {"content": b"x" * 5000}),  # past max_body_bytes
        ("POST", "/sessions/nope/v1/" + suffix, {"json": {}}),
        ("GET", "/sessions/{sid}/v1/" + suffix, {}),  # not a turn: FastAPI's 405, Allow included
        ("POST", "/sessions/{sid}/v1/" + suffix + "/", {"json": {}}),
    ]
    for method, path, kw in cases:
        got = _answer(direct, method, path.format(sid=sid_d), **kw)
        want = _answer(routed, method, path.format(sid=sid_r), **kw)
        # each app has its own session id, echoed in some messages
        assert (got[0], got[1], str(got[2]).replace(sid_d, "S")) == \
            (want[0], want[1], str(want[2]).replace(sid_r, "S")), (method, path)
        assert got[0] >= 400


def test_the_direct_path_matches_only_turn_routes() -> None:
    assert direct_route("/sessions/s1/v1/chat/completions") == ("s1", "chat/completions")
    assert direct_route("/sessions/s1/v1/messages/count_tokens") == ("s1", "messages/count_tokens")
    for path in ("/sessions//v1/messages", "/sessions/s1/v1/models", "/sessions/s1/v2/messages",
                 "/sessions/s1/v1/responses/r1", "/sessions/s1/trajectory", "/sessions/a/b/v1/messages"):
        assert direct_route(path) is None, path


def test_a_turn_skips_starlettes_router_and_an_unexpected_error_is_a_contained_500(
        clients: tuple[TestClient, TestClient], monkeypatch: pytest.MonkeyPatch) -> None:
    direct, _ = clients
    sid = _session(direct)
    seen: list[list[str]] = []

    async def boom(self: TurnEndpoint, session_id: str, request: Any, dialect: Any) -> Any:
        seen.append([f.filename for f in inspect.stack()])
        raise RuntimeError("a bug")

    monkeypatch.setattr(TurnEndpoint, "handle", boom)
    r = direct.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    assert r.json() == {"error": {"type": "internal_error", "message": "RuntimeError"}}
    assert seen and not any(f.replace("\\", "/").endswith("starlette/routing.py") for f in seen[0])
    monkeypatch.undo()
    assert direct.get("/health").status_code == 200  # the app still serves
    metrics = direct.get("/metrics").text
    assert 'tito_errors_total{type="internal_error"}' in metrics
