"""What an error echoes and which status a made-up session id gets on a lone server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from session_server.app import AppConfig, create_app
from session_server.context import Settings

ECHO_CHARS = 64  # what an error quotes of a client-supplied id (errors.shown)


@pytest.fixture(scope="module")
def client(tokenizer_dirs: dict[str, Path]) -> Iterator[TestClient]:
    """A server with an instance id and no peers: no other instance exists."""
    app = create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]),
                               settings=Settings(cpu_workers=1, decode_processes=0, instance_id="w1")))
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("sid", ["0." + "ab" * 16, "w0." + "cd" * 16, "w1." + "ef" * 16, "ab" * 16])
def test_a_made_up_session_id_on_a_server_without_peers_is_404(client: TestClient, sid: str) -> None:
    """Ids encode their instance, but with no peers there is no instance 0 to route to: a
    421 "route to instance 0" would send the client after something that does not exist."""
    for method, path in [("GET", f"/sessions/{sid}"), ("POST", f"/sessions/{sid}/v1/chat/completions"),
                         ("DELETE", f"/sessions/{sid}")]:
        r = client.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["type"] == "session_not_found"


def test_a_404_echoes_a_long_session_id_cut_short(client: TestClient) -> None:
    sid = "x" * 60_000
    for path in (f"/sessions/{sid}", f"/sessions/{sid}/v1/messages"):
        r = client.post(path, json={}) if path.endswith("messages") else client.get(path)
        assert r.status_code == 404, r.text[:200]
        message = r.json()["error"]["message"]
        assert len(message) < 200 and ("x" * ECHO_CHARS) in message and "…" in message, message
    short = "y" * 10
    assert repr(short) in client.get(f"/sessions/{short}").json()["error"]["message"]  # a short id in full


def test_an_unknown_response_id_is_echoed_cut_short(client: TestClient) -> None:
    sid = client.post("/sessions", json={}).json()["session_id"]
    r = client.post(f"/sessions/{sid}/v1/responses", json={"input": "hi", "previous_response_id": "r" * 50_000})
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 400, r.text[:200]
