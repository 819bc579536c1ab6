"""The viewer's login and cookie: where the login sends the browser back is only ever
one of this server's viewer paths (anything else, `/ui`), never a raw 500 or a dropped
connection, and a page load sent to it keeps its query string; the cookie carries a
signed expiry, and a viewer's reads do not keep a session alive."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from session_server.app import AppConfig, create_app
from session_server.auth import (
    UI_COOKIE_TTL_S,
    VIEWER_ROUTES,
    Access,
    classify,
    is_viewer_route,
    ui_cookie_value,
)
from session_server.context import Settings

ADMIN = "admin-secret-token"


@pytest.fixture(scope="module")
def client(tokenizer_dirs: dict[str, Path]) -> Iterator[TestClient]:
    settings = Settings(admin_token=ADMIN, cpu_workers=1, decode_processes=0)
    app = create_app(AppConfig(tokenizer=str(tokenizer_dirs["qwen3"]), settings=settings))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize(("target", "back"), [
    ("/ui/sessions/abc?state=done&busy=true", "/ui/sessions/abc?state=done&busy=true"),
    ("/ui/control", "/ui/control"),
    ("/ui\r\nX-Injected: y", "/ui"),  # a header split
    ("/ui\u2603", "/ui"),  # not latin-1: the header could not be encoded
    ("/ui?x=\u2603", "/ui"),
    ("//evil.example/ui", "/ui"),
    ("/uievil", "/ui"),
    ("/ui/..\\evil", "/ui"),
    ("https://evil.example/ui", "/ui"),
])
def test_login_sends_back_only_to_a_viewer_path(client: TestClient, target: str, back: str) -> None:
    r = client.post("/ui/login", data={"token": ADMIN, "next": target}, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert r.headers["location"] == back
    assert "x-injected" not in r.headers
    client.cookies.clear()
    form = client.get("/ui/login", params={"next": target})
    assert form.status_code == 200 and f'value="{back.replace("&", "&amp;")}"' in form.text


def test_a_page_load_sent_to_login_keeps_its_query_string(client: TestClient) -> None:
    client.cookies.clear()  # signed in by another case: this one is a browser without the cookie
    r = client.get("/ui/sessions/abc?state=done&meta=task%3Dt1", follow_redirects=False)
    assert r.status_code == 303
    location = r.headers["location"]
    assert location.startswith("/ui/login?next=")
    form = client.get(location)
    assert 'value="/ui/sessions/abc?state=done&amp;meta=task%3Dt1"' in form.text
    back = client.post("/ui/login", data={"token": ADMIN, "next": "/ui/sessions/abc?state=done&meta=task%3Dt1"},
                       follow_redirects=False)
    assert back.headers["location"] == "/ui/sessions/abc?state=done&meta=task%3Dt1"


def test_the_viewer_cookie_expires_by_its_signed_value_and_max_age(client: TestClient) -> None:
    client.cookies.clear()
    r = client.post("/ui/login", data={"token": ADMIN, "next": "/ui"}, follow_redirects=False)
    assert f"Max-Age={UI_COOKIE_TTL_S}" in r.headers["set-cookie"]
    client.cookies.clear()
    now = int(time.time())
    good = ui_cookie_value(ADMIN)
    expired = ui_cookie_value(ADMIN, expires=now - 1)
    stretched = f"{now + 10 * UI_COOKIE_TTL_S}.{expired.partition('.')[2]}"  # a later expiry, the old signature
    other = ui_cookie_value("another-token")
    for value, ok in ((good, True), (expired, False), (stretched, False), (other, False), ("garbage", False)):
        r = client.get("/engines", cookies={"tito_ui": value})
        assert r.status_code == (200 if ok else 401), (value, r.status_code)


def test_a_viewers_reads_do_not_keep_a_session_alive(client: TestClient) -> None:
    client.cookies.clear()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    sid = client.post("/sessions", json={}, headers=admin).json()["session_id"]
    session = client.app.state.ctx.store.all()[sid]  # type: ignore[attr-defined]
    for path in (f"/sessions/{sid}", f"/sessions/{sid}/trajectory", f"/sessions/{sid}/samples"):
        before = session.last_used
        time.sleep(0.01)
        assert client.get(path, cookies={"tito_ui": ui_cookie_value(ADMIN)}).status_code == 200
        assert client.get(path, headers={**admin, "x-tito-viewer": "1"}).status_code == 200
        assert session.last_used == before, path  # the viewer read it: not use
        assert client.get(path, headers=admin).status_code == 200
        assert session.last_used > before, path  # the trainer read it: use, its TTL restarts


# the admin GET routes the viewer's pages never read: its cookie must not open them
ADMIN_ONLY_READS = {"/metrics"}


def test_the_viewer_cookie_reads_the_viewers_routes_and_nothing_else(client: TestClient) -> None:
    client.cookies.clear()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    sid = client.post("/sessions", json={}, headers=admin).json()["session_id"]
    cookie = {"tito_ui": ui_cookie_value(ADMIN)}
    reads = sorted({r.path for r in client.app.routes  # type: ignore[attr-defined]
                    if "GET" in getattr(r, "methods", ()) and classify(r.path)[0] is Access.ADMIN})
    # every admin read is decided: the viewer's (its list) or admin-only (this test's)
    assert {p for p in reads if not is_viewer_route(p)} == ADMIN_ONLY_READS
    fill = {"{sid}": sid, "{name}": "session.js"}
    for path in VIEWER_ROUTES:
        for k, v in fill.items():
            path = path.replace(k, v)
        if path.endswith("/live"):
            continue  # an endless stream: its auth is the same check, tested with the pages
        params = {"branch": 0} if path.endswith(("/tokens", "/line")) else {}
        r = client.get(path, params=params, cookies=cookie, follow_redirects=False)
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
    for path in (*ADMIN_ONLY_READS, "/no/such/route", f"/sessions/{sid}/nothing"):
        assert client.get(path, cookies=cookie).status_code == 401, path
        assert client.get(path, headers=admin).status_code != 401, path  # the admin token still reads it
    assert client.post("/samples", json={"session_ids": [sid]}, cookies=cookie).status_code == 401
