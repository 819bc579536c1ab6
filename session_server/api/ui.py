"""The trajectory viewer's pages: `GET /ui`, served by the server itself, offline.

One page shell (`ui_static/index.html`) serves every view: the session list (`/ui`),
one session (`/ui/sessions/{sid}`) and the control page (`/ui/control`); the script
(`ui_static/*.js`, hand-written, no framework, nothing fetched from elsewhere) reads the
path and asks the JSON routes for the data (`ui_data.py` and the routes every client
has). The files ship in the wheel (pyproject's package data) and are read once.

Model output is adversarial: the script puts session text into the page only as text
(`textContent`, never `innerHTML`), and every page is sent with a Content-Security-Policy
that runs no inline script and loads nothing from another origin, so a `<script>` a
model wrote is shown, never run, even if a later change forgot to escape it.

With `--admin-token` every page and its data need the token (`auth.py`); a browser
cannot send a bearer header on a page load, so `/ui/login` takes the token once and
sets the viewer cookie (`auth.ui_cookie_value`), good for reading only.
"""

from __future__ import annotations

import hmac
import html
import re
import urllib.parse
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..auth import UI_COOKIE, UI_COOKIE_TTL_S, ui_cookie_value
from .routes.common import ctx_of, read_body

__all__ = ["PAGE_HEADERS", "router"]

router = APIRouter()

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
# the files a page may load, by name: nothing else under the package is ever served
STATIC = ("viewer.css", "common.js", "list.js", "session.js", "tokens.js", "coverage.js", "live.js", "control.js",
          "main.js")

PAGE_HEADERS = {
    "content-security-policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

_files: dict[str, bytes] = {}


def _file(name: str) -> bytes:
    """A packaged file's bytes, read once (a few KB each)."""
    if name not in _files:
        _files[name] = resources.files(__package__).joinpath("ui_static", name).read_bytes()
    return _files[name]


def _send(name: str) -> Response:
    suffix = name[name.rfind("."):]
    return Response(content=_file(name), media_type=_TYPES[suffix], headers=PAGE_HEADERS)


@router.get("/ui", include_in_schema=False)
@router.get("/ui/", include_in_schema=False)
@router.get("/ui/control", include_in_schema=False)
async def page() -> Response:
    return _send("index.html")


@router.get("/ui/sessions/{sid}", include_in_schema=False)
async def session_page(sid: str) -> Response:
    return _send("index.html")


@router.get("/ui/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404, headers=PAGE_HEADERS)
    return _send(name)


# a viewer path of this server and an optional query, printable ASCII only: no `//host`,
# no scheme, no backslash, no CR/LF (a header split) and nothing a latin-1 header cannot hold
_NEXT = re.compile(r"/ui(?:/[A-Za-z0-9._~%/-]*)?(?:\?[ -~]*)?")


def _safe_next(target: str) -> str:
    """Where the login sends the browser back: `target` when it is one of this server's
    viewer paths (`_NEXT`, matched whole), else `/ui`. It goes into a `location` header,
    so anything looser is an open redirect, a header split or an unencodable header."""
    return target if _NEXT.fullmatch(target) else "/ui"


def _login_form(target: str, status: int = 200) -> Response:
    """The login page, coming back to `target` (escaped: it is the client's input)."""
    body = _file("login.html").replace(b'value="/ui"', f'value="{html.escape(_safe_next(target))}"'.encode())
    return Response(content=body, status_code=status, media_type=_TYPES[".html"], headers=PAGE_HEADERS)


@router.get("/ui/login", include_in_schema=False)
async def login_page(next: str = "/ui") -> Response:
    return _login_form(next)


@router.post("/ui/login", include_in_schema=False)
async def login(request: Request) -> Response:
    """The admin token from the login form: right, the viewer cookie and back to the page
    asked for (303); wrong, the form again with 403. Without auth the viewer is open."""
    ctx = ctx_of(request)
    form = urllib.parse.parse_qs((await read_body(request, 8192)).decode("utf-8", "replace"))
    target = _safe_next(form.get("next", ["/ui"])[0])
    admin = ctx.settings.admin_token
    if admin is None:
        return Response(status_code=303, headers={"location": target})
    token = form.get("token", [""])[0].strip().encode()
    if not hmac.compare_digest(token, admin.encode()):
        return _login_form(target, 403)
    secure = "; Secure" if request.url.scheme == "https" else ""
    cookie = (f"{UI_COOKIE.decode()}={ui_cookie_value(admin)}; Max-Age={UI_COOKIE_TTL_S}; Path=/; HttpOnly; "
              f"SameSite=Strict{secure}")
    return Response(status_code=303, headers={"location": target, "set-cookie": cookie, "cache-control": "no-store"})
