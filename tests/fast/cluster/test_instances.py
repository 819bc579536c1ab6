"""Every session id carries its instance (`{instance}.{32 hex}`), so a proxy
routes by path alone; a request for another instance's session is a 421 naming it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from session_server.app import AppConfig, create_app
from session_server.context import Settings
from session_server.ops import cli
from session_server.sessions import SessionConfig, SessionStore, instance_of


def _app(tokenizer_dirs: dict[str, Path], **kw: Any) -> Any:
    return create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]),
                                settings=Settings(cpu_workers=1, decode_processes=0, **kw)))


def test_session_ids_carry_the_instance_and_128_random_bits(tokenizer_dirs: dict[str, Path]) -> None:
    with TestClient(_app(tokenizer_dirs, instance_id="w3")) as c, TestClient(_app(tokenizer_dirs)) as d:
        made = {c.post("/sessions", json={}).json()["session_id"] for _ in range(20)}
        assert all(re.fullmatch(r"w3\.[0-9a-f]{32}", sid) for sid in made) and len(made) == 20
        # unset: a random instance id, the same one /health reports and every id starts with
        own = d.get("/health").json()["instance_id"]
        sid = d.post("/sessions", json={}).json()["session_id"]
        assert instance_of(sid) == own and re.fullmatch(r"[0-9a-f]{16}\.[0-9a-f]{32}", sid)
        assert d.get(f"/sessions/{sid}").status_code == 200


def test_another_instances_session_is_421_naming_it_and_nothing_is_touched(
    tokenizer_dirs: dict[str, Path],
) -> None:
    # a cluster member: it has a peer (down here: port 9 refuses), so other instances exist
    with TestClient(_app(tokenizer_dirs, instance_id="w0", peers=["http://127.0.0.1:9"])) as c:
        mine = c.post("/sessions", json={}).json()["session_id"]
        theirs = "w1." + mine.split(".", 1)[1]  # the same random part under another instance
        for method, path in [("GET", f"/sessions/{theirs}"), ("DELETE", f"/sessions/{theirs}"),
                             ("POST", f"/sessions/{theirs}/v1/chat/completions"),
                             ("GET", f"/sessions/{theirs}/trajectory")]:
            r = c.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 421, (method, path, r.text)
            err = r.json()["error"]
            assert err["type"] == "wrong_instance" and "'w1'" in err["message"] and "'w0'" in err["message"]
        assert c.get(f"/sessions/{mine}").json()["turns"] == 0  # untouched
        # an unprefixed id (or this instance's unknown one) is a plain 404
        assert c.get("/sessions/" + "ab" * 16).json()["error"]["type"] == "session_not_found"
        assert c.get("/sessions/w0." + "cd" * 16).status_code == 404
        # a prefix no instance can have (found by the schema fuzzer on POST /samples) is a 404
        for bogus in ["W1." + "cd" * 16, "-x." + "cd" * 16, "\u00e9t\u00e9.x"]:
            assert instance_of(bogus) is None
            assert c.get(f"/sessions/{bogus}").status_code == 404
            r = c.post("/samples", json={"session_ids": [bogus]})
            assert r.status_code == 404 and r.json()["error"]["type"] == "session_not_found", r.text


def test_store_without_instance_keeps_bare_ids() -> None:
    store = SessionStore()
    s = store.create(SessionConfig(ttl_s=60))
    assert re.fullmatch(r"[0-9a-f]{32}", s.id) and store.get(s.id) is s


def test_base_url_is_built_from_the_request_host(tokenizer_dirs: dict[str, Path]) -> None:
    """Behind a proxy the Host header is the proxy's: the agent's base_url points there."""
    with TestClient(_app(tokenizer_dirs, instance_id="w0")) as c:
        body = c.post("/sessions", json={}, headers={"Host": "proxy.example:8000"}).json()
        assert body["base_url"] == f"http://proxy.example:8000/sessions/{body['session_id']}/v1"


@pytest.mark.parametrize("bad", ["W0", "w0.x", "-w0", "w0-", "a" * 33, "", "w 0", "w_0"])
def test_instance_id_is_validated(bad: str) -> None:
    with pytest.raises(ValidationError, match="instance id"):
        Settings(instance_id=bad)


@pytest.mark.parametrize("good", ["w0", "pod-7", "tito-3", "a" * 32, "0"])
def test_instance_id_accepts_dns_label_names(good: str) -> None:
    assert Settings(instance_id=good).instance_id == good


def test_peers_setting_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["serve", "--engine", "http://x:1", "--tokenizer", "t"]
    args = cli.build_parser().parse_args([*base, "--peers", "http://127.0.0.1:1", "--peers", "http://127.0.0.1:2"])
    assert cli.settings_from_args(args).peers == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    monkeypatch.setenv("TITO_PEERS", '["http://h:3"]')
    assert cli.settings_from_args(cli.build_parser().parse_args(base)).peers == ["http://h:3"]
    monkeypatch.delenv("TITO_PEERS")
    assert cli.settings_from_args(cli.build_parser().parse_args(base)).peers == []
