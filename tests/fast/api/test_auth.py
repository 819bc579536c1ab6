"""Optional bearer auth: every real route x {no token, wrong token, other session's
token, right token}, the agent path through the openai client, and `/health` identity."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import AsyncOpenAI

from session_server.app import AppConfig, create_app
from session_server.auth import Access, classify, is_ui_page, presented_tokens
from session_server.context import Settings

from ..stack import CHAT, live_stack

ADMIN = "admin-secret-token"

# Every route of the real app and who may call it. A route missing here fails
# `test_auth_every_route_is_classified`: a new route cannot escape the matrix.
EXPECTED: dict[tuple[str, str], Access] = {
    ("GET", "/health"): Access.OPEN,
    ("GET", "/metrics"): Access.ADMIN,
    ("POST", "/sessions"): Access.ADMIN,  # rollout workers create sessions with the admin token
    ("POST", "/sessions/{sid}/v1/chat/completions"): Access.SESSION,
    ("POST", "/sessions/{sid}/v1/messages"): Access.SESSION,
    ("POST", "/sessions/{sid}/v1/messages/count_tokens"): Access.SESSION,
    ("GET", "/sessions/{sid}"): Access.ADMIN,
    ("HEAD", "/sessions/{sid}"): Access.ADMIN,  # the harness probe of its base URL
    ("GET", "/sessions/{sid}/trajectory"): Access.ADMIN,
    ("DELETE", "/sessions/{sid}"): Access.ADMIN,  # also ?return_trajectory=true
    # training samples and rewards: the trainer's, never the agent's
    ("GET", "/sessions/{sid}/samples"): Access.ADMIN,
    ("POST", "/sessions/{sid}/reward"): Access.ADMIN,
    ("POST", "/samples"): Access.ADMIN,
    ("POST", "/control/pause"): Access.ADMIN,
    ("POST", "/control/resume"): Access.ADMIN,
    ("GET", "/control/state"): Access.ADMIN,
    ("POST", "/control/weight_version"): Access.ADMIN,
    ("GET", "/engines"): Access.ADMIN,
    ("POST", "/engines"): Access.ADMIN,
    ("DELETE", "/engines/{engine_id}"): Access.ADMIN,
    ("DELETE", "/engines"): Access.ADMIN,
    # the served model's name: what clients probe first; no session data
    ("GET", "/v1/models"): Access.OPEN,
    ("GET", "/sessions/{sid}/v1/models"): Access.SESSION,
    ("GET", "/sessions/{sid}/v1/models/{model_id:path}"): Access.SESSION,
    # the Responses dialect: the agent's own turns and stored responses
    ("POST", "/sessions/{sid}/v1/responses"): Access.SESSION,
    ("GET", "/sessions/{sid}/v1/responses/{response_id}"): Access.SESSION,
    # FastAPI's schema and docs pages: public description of the API, no data
    ("GET", "/openapi.json"): Access.OPEN,
    ("HEAD", "/openapi.json"): Access.OPEN,
    ("GET", "/docs"): Access.OPEN,
    ("HEAD", "/docs"): Access.OPEN,
    ("GET", "/docs/oauth2-redirect"): Access.OPEN,
    ("HEAD", "/docs/oauth2-redirect"): Access.OPEN,
    ("GET", "/redoc"): Access.OPEN,
    ("HEAD", "/redoc"): Access.OPEN,
    # the trajectory viewer: its pages and data are the admin's (read with the viewer
    # cookie too); its login page takes the token and holds nothing
    ("GET", "/ui"): Access.ADMIN,
    ("GET", "/ui/"): Access.ADMIN,
    ("GET", "/ui/control"): Access.ADMIN,
    ("GET", "/ui/sessions/{sid}"): Access.ADMIN,
    ("GET", "/ui/static/{name}"): Access.ADMIN,
    ("GET", "/ui/api/sessions"): Access.ADMIN,
    ("GET", "/ui/api/meta"): Access.ADMIN,
    ("GET", "/sessions/{sid}/tokens"): Access.ADMIN,
    ("GET", "/sessions/{sid}/line"): Access.ADMIN,
    ("GET", "/sessions/{sid}/live"): Access.ADMIN,
    ("GET", "/ui/login"): Access.OPEN,
    ("POST", "/ui/login"): Access.OPEN,
}


def _flat(routes: list[Any]) -> Iterator[Any]:
    """The routes, those of an included APIRouter too (FastAPI keeps one as one node)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _flat(inner.routes)
        else:
            yield route


def _real_routes() -> list[tuple[str, str]]:
    app = create_app(AppConfig(tokenizer="unused: routes only"))
    out = []
    for route in _flat(app.routes):
        methods = getattr(route, "methods", None) or {"GET"}
        out += [(m, str(getattr(route, "path", ""))) for m in sorted(methods)]
    return sorted(out)


ROUTES = _real_routes()
CREDS = ("none", "wrong", "other_session", "own_session", "admin")


def test_auth_every_route_is_classified() -> None:
    missing = [r for r in ROUTES if r not in EXPECTED]
    assert not missing, f"routes without an auth class in EXPECTED: {missing}"
    assert any(m == "POST" and p.startswith("/sessions/{sid}/v1/") for m, p in ROUTES)


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_auth_classify_matches_the_expected_class(method: str, path: str) -> None:
    concrete = path.replace("{sid}", "abc123").replace("{engine_id}", "e1")
    assert classify(concrete)[0] is EXPECTED[(method, path)]


@pytest.fixture(scope="module")
def client(tokenizer_dirs: dict[str, Path]) -> Iterator[TestClient]:
    settings = Settings(admin_token=ADMIN, cpu_workers=1, decode_processes=0)
    app = create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]), settings=settings))
    with TestClient(app) as c:
        yield c


def _new_session(c: TestClient) -> dict[str, Any]:
    r = c.post("/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.text
    return dict(r.json())


@pytest.mark.parametrize("cred", CREDS)
@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_auth_route_matrix(client: TestClient, method: str, path: str, cred: str) -> None:
    access = EXPECTED[(method, path)]
    mine, other = _new_session(client), _new_session(client)  # fresh: a DELETE must not leak into the next case
    token = {"none": None, "wrong": "not-a-token", "other_session": other["api_key"],
             "own_session": mine["api_key"], "admin": ADMIN}[cred]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = path.replace("{sid}", mine["session_id"]).replace("{engine_id}", "e999")
    if (method, path) == ("DELETE", "/sessions/{sid}"):
        url += "?return_trajectory=true"
    allowed = (
        access is Access.OPEN
        or cred == "admin"
        or (access is Access.SESSION and cred == "own_session")
    )
    if allowed and path == "/sessions/{sid}/live":
        return  # an endless event stream (TestClient reads a body whole): test_viewer_pages reads it
    r = client.request(method, url, headers=headers, content=b"{}" if method == "POST" else None,
                       follow_redirects=False)
    if not allowed and cred == "none" and is_ui_page(url):  # a browser's page load: to the login page
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next=/ui"), r.headers
        return
    if allowed:
        assert r.status_code != 401, (method, url, cred, r.text)
    else:
        assert r.status_code == 401, (method, url, cred, r.status_code, r.text)
        if method == "HEAD":  # a HEAD reply has no body
            assert r.content == b""
        elif "/v1/messages" in path:  # the Anthropic routes answer in Anthropic's shape
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
        else:
            assert r.json() == {"error": {"type": "unauthorized", "message": r.json()["error"]["message"]}}
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_auth_unknown_route_needs_admin_token(client: TestClient) -> None:
    assert client.get("/no-such-route").status_code == 401  # (it was /samples, which became a route)
    assert client.get("/no-such-route", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404


def test_auth_session_token_also_accepted_as_x_api_key_on_agent_routes(client: TestClient) -> None:
    s = _new_session(client)
    url = f"/sessions/{s['session_id']}/v1/chat/completions"
    assert client.post(url, content=b"{}", headers={"x-api-key": s["api_key"]}).status_code == 400
    assert client.post(url, content=b"{}", headers={"x-api-key": "nope"}).status_code == 401
    # x-api-key is the agent dialect only: the control plane wants Authorization
    assert client.get("/engines", headers={"x-api-key": ADMIN}).status_code == 401


def test_auth_bearer_scheme_is_case_insensitive_and_non_ascii_tokens_are_just_wrong(client: TestClient) -> None:
    assert client.get("/engines", headers={"Authorization": f"bearer {ADMIN}"}).status_code == 200
    r = client.get("/engines", headers=[(b"authorization", "Bearer caf\u00e9".encode("latin-1"))])
    assert r.status_code == 401
    assert presented_tokens([(b"authorization", b"Basic abc")], allow_api_key=True) == []


def test_auth_off_by_default(tokenizer_dirs: dict[str, Path]) -> None:
    app = create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]), settings=Settings(cpu_workers=1, decode_processes=0)))
    with TestClient(app) as c:
        r = c.post("/sessions", json={})
        assert r.status_code == 201 and r.json()["api_key"]  # returned anyway: clients can always send it
        assert c.get(f"/sessions/{r.json()['session_id']}/trajectory").status_code == 200
        assert c.get("/engines").status_code == 200


def test_auth_empty_admin_token_is_refused() -> None:
    with pytest.raises(ValueError, match="admin token"):
        create_app(AppConfig(tokenizer="unused", settings=Settings(admin_token=" ")))


def test_auth_unauthorized_counted_in_metrics(client: TestClient) -> None:
    client.get("/control/state")
    text = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    line = next(x for x in text.splitlines() if x.startswith("tito_errors_total") and 'type="unauthorized"' in x)
    assert float(line.rsplit(" ", 1)[1]) >= 1


def test_health_reports_a_stable_instance_id(tokenizer_dirs: dict[str, Path]) -> None:
    def app(**kw: Any) -> Any:
        return create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]),
                                    settings=Settings(cpu_workers=1, decode_processes=0, **kw)))

    with TestClient(app(admin_token=ADMIN)) as a, TestClient(app()) as b, TestClient(app(instance_id="pod-7")) as c:
        first = a.get("/health").json()  # open even with auth on
        assert first["status"] == "ok" and re.fullmatch(r"[0-9a-f]{16}", first["instance_id"])
        assert a.get("/health").json()["instance_id"] == first["instance_id"]
        assert b.get("/health").json()["instance_id"] != first["instance_id"]
        assert c.get("/health").json()["instance_id"] == "pod-7"


async def test_auth_agent_with_session_api_key_streams_through_openai_client(qwen3_dir: Path) -> None:
    """The newcomer's path with auth on: the worker creates the session with the admin
    token, the agent uses only `base_url` + `api_key`; streaming passes the middleware."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with live_stack(qwen3_dir, settings=Settings(admin_token=ADMIN)) as st:
        created = (await st.http.post("/sessions", json={}, headers=admin)).json()
        agent = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
        msgs: list[Any] = CHAT["messages"]
        full = await agent.chat.completions.create(model="m", messages=msgs, max_tokens=32)
        assert full.choices[0].message.content is not None
        msgs = [*msgs, full.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        stream = await agent.chat.completions.create(model="m", messages=msgs, max_tokens=32, stream=True)
        chunks = [c async for c in stream]
        await agent.close()
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        traj = await st.http.get(f"/sessions/{created['session_id']}/trajectory", headers=admin)
        assert traj.status_code == 200 and len(traj.json()["branches"][0]["turns"]) == 2
        async with httpx.AsyncClient(base_url=st.url) as anon:
            denied = await anon.get(f"/sessions/{created['session_id']}/trajectory",
                                    headers={"Authorization": f"Bearer {created['api_key']}"})
        assert denied.status_code == 401
