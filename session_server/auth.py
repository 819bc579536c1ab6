"""Optional bearer auth (off by default) and the process identity `/health` reports.

Two kinds of credential:

- the **admin token** (``serve --admin-token`` / ``SESSION_SERVER_ADMIN_TOKEN``),
  held by the trainer and its rollout workers: valid on every route;
- a **session token**, minted per session at creation and handed to the agent as
  its OpenAI ``api_key``: valid only on that session's agent routes
  (``/sessions/{sid}/v1/...``), so an agent can neither read its own (or another
  session's) trajectory nor touch the control plane.

Which class a request falls in is decided from its path alone (`classify`), and
everything that is neither open nor an agent route needs the admin token, so a
route added later is protected without anyone remembering to list it.

A pure ASGI middleware, not ``BaseHTTPMiddleware``: it looks at the headers and
either answers 401 itself or hands the untouched ``receive``/``send`` on, so
request bodies are never buffered and streamed responses stay streamed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import orjson

from .api.error_map import error_body
from .errors import Recovering, ServiceError, SessionGone, Unauthorized

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Schema and docs pages describe the API (public, like the source); they hold no data.
# The viewer's login page takes the admin token and holds nothing else.
OPEN_PATHS = frozenset({"/health", "/v1/models", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/ui/login"})

# The trajectory viewer's credential (api/ui.py): a browser cannot send a bearer header
# on a page load, so `/ui/login` sets this cookie, derived from the admin token (the
# token itself never sits in the browser). It is accepted for reads (GET; HEAD, which only
# `/sessions/{sid}` routes, the others answering 405) of the viewer's own routes only (`VIEWER_ROUTES`; every route that changes anything is a POST
# or DELETE), HttpOnly and SameSite=Strict: the viewer reads, and another site can
# neither read nor make it act.
UI_COOKIE = b"tito_ui"
READ_METHODS = frozenset({"GET", "HEAD"})

# Every path the viewer's pages load or read (`api/ui_static/*.js`), the one place that
# says so: the cookie opens these and nothing else, so a stolen cookie reads what the
# viewer shows, never `/metrics` or a route added later. `{x}` is one path segment. A
# page that reads a new route adds it here (the login browser test fails on any read
# the cookie is refused; the cookie test on any admin GET route left undecided).
VIEWER_ROUTES = (
    "/ui", "/ui/", "/ui/control", "/ui/sessions/{sid}", "/ui/static/{name}",
    "/ui/api/sessions", "/ui/api/meta",
    "/sessions/{sid}", "/sessions/{sid}/trajectory", "/sessions/{sid}/samples", "/sessions/{sid}/line",
    "/sessions/{sid}/tokens", "/sessions/{sid}/live",
    "/control/state", "/engines",
)
_VIEWER_PATH = re.compile("|".join(re.sub(r"\\{\w+\\}", "[^/]+", re.escape(r)) for r in VIEWER_ROUTES))


def is_viewer_route(path: str) -> bool:
    """A path of `VIEWER_ROUTES` (matched whole): one the viewer cookie may read."""
    return _VIEWER_PATH.fullmatch(path) is not None


class Access(enum.Enum):
    OPEN = "open"  # no credential needed
    SESSION = "session"  # that session's token or the admin token
    ADMIN = "admin"  # the admin token only


def new_instance_id() -> str:
    """Random per process: lets a client tell a restarted server (sessions gone) from a blip."""
    return secrets.token_hex(8)


def classify(path: str) -> tuple[Access, str | None]:
    """Access class of a request path, and the session id for agent routes."""
    if path in OPEN_PATHS:
        return Access.OPEN, None
    parts = path.split("/", 4)  # "", "sessions", sid, "v1", rest
    if len(parts) == 5 and parts[1] == "sessions" and parts[3] == "v1" and parts[2] and parts[4]:
        return Access.SESSION, parts[2]
    return Access.ADMIN, None


UI_COOKIE_TTL_S = 12 * 3600  # a viewer signs in again after this: a copied cookie does not work for ever
# a viewer's own reads (the page's fetches send it; the cookie implies it) are not use:
# an open viewer must not keep a session from expiring (sessions.py `touch`)
VIEWER_HEADER = "x-tito-viewer"


def ui_cookie_value(admin_token: str, expires: int | None = None) -> str:
    """The viewer cookie's value for `admin_token`: `<expiry>.<keyed hash of it>` (the
    cookie proves the token was presented without being it, and until when it holds;
    the expiry is inside the signed value, so a browser that ignores `Max-Age` or a
    copied cookie still stops working at it). `expires`: unix seconds, default now + 12 h."""
    if expires is None:
        expires = int(time.time()) + UI_COOKIE_TTL_S
    mac = hmac.new(admin_token.encode(), b"tito-ui-cookie-v2|%d" % expires, hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


def ui_cookie_ok(admin_token: bytes, cookie: bytes, now: float) -> bool:
    """Whether `cookie` is a viewer cookie this token signed that has not expired."""
    expires, dot, mac = cookie.partition(b".")
    if not dot or not expires.isdigit() or len(expires) > 12 or int(expires) <= now:
        return False
    want = hmac.new(admin_token, b"tito-ui-cookie-v2|" + expires, hashlib.sha256).hexdigest().encode()
    return hmac.compare_digest(mac, want)


def is_viewer(scope: Scope) -> bool:
    """A request of the viewer (its cookie, or its page's `x-tito-viewer` header)."""
    return bool(scope.get("state", {}).get("viewer")) or any(k == VIEWER_HEADER.encode() for k, _ in scope["headers"])


def _cookie(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == b"cookie":
            for part in value.split(b";"):
                k, _, v = part.strip().partition(b"=")
                if k == name and v:
                    return v
    return None


def is_ui_page(path: str) -> bool:
    """A viewer page a browser navigates to (a denied load goes to the login page)."""
    return (path == "/ui" or path.startswith("/ui/")) and not path.startswith(("/ui/api/", "/ui/static/"))


def presented_tokens(headers: Iterable[tuple[bytes, bytes]], *, allow_api_key: bool) -> list[bytes]:
    """Credentials in `Authorization: Bearer T` (any case of the scheme) and, on agent
    routes, Anthropic-style `x-api-key: T`."""
    out: list[bytes] = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                out.append(token.strip())
        elif allow_api_key and name == b"x-api-key" and value.strip():
            out.append(value.strip())
    return out


def _matches(presented: list[bytes], expected: bytes) -> bool:
    # compare_digest on bytes: constant time, and never raises on non-ASCII input
    ok = False
    for token in presented:
        ok |= hmac.compare_digest(token, expected)
    return ok


class BearerAuth:
    """ASGI middleware enforcing `classify`; the session store is read from app state."""

    def __init__(self, app: ASGIApp, admin_token: str) -> None:
        self.app = app
        self.admin = admin_token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access, sid = classify(scope["path"])
        if access is Access.OPEN:
            await self.app(scope, receive, send)
            return
        presented = presented_tokens(scope["headers"], allow_api_key=access is Access.SESSION)
        if _matches(presented, self.admin) or (sid is not None and self._session_ok(scope, sid, presented)):
            await self.app(scope, receive, send)
            return
        if access is Access.ADMIN and scope["method"] in READ_METHODS:
            cookie = _cookie(scope["headers"], UI_COOKIE) if is_viewer_route(scope["path"]) else None
            if cookie is not None and ui_cookie_ok(self.admin, cookie, time.time()):
                scope.setdefault("state", {})["viewer"] = True  # its reads are not use (`is_viewer`)
                await self.app(scope, receive, send)
                return
            if not presented and is_ui_page(scope["path"]):
                await _to_login(scope, send)
                return
        if sid is not None and presented and (unheld := self._unheld(scope, sid)) is not None:
            await _send_error(scope, send, unheld, [])
            return
        await self._deny(scope, send, bool(presented), access)

    @staticmethod
    def _unheld(scope: Scope, sid: str) -> ServiceError | None:
        """Why a session's own token cannot be checked now: the journal still replays it
        (503, retried), or it is gone (410, not retried): a 401 would tell its agent to
        stop for good, or to retry forever. Reveals nothing of a live session."""
        ctx = getattr(scope["app"].state, "ctx", None)
        if ctx is None or sid in ctx.store.all():
            return None
        try:
            ctx.store.get(sid)
        except (Recovering, SessionGone) as exc:
            return exc
        except ServiceError:
            return None
        return None

    @staticmethod
    def _session_ok(scope: Scope, sid: str, presented: list[bytes]) -> bool:
        ctx = getattr(scope["app"].state, "ctx", None)
        session = ctx.store.all().get(sid) if ctx is not None else None
        return session is not None and _matches(presented, session.token.encode())

    @staticmethod
    async def _deny(scope: Scope, send: Send, had_token: bool, access: Access) -> None:
        need = "this session's token or the admin token" if access is Access.SESSION else "the admin token"
        what = "invalid credentials" if had_token else "missing credentials"
        how = "'Authorization: Bearer <token>'" + (" or 'x-api-key: <token>'" if access is Access.SESSION else "")
        err = Unauthorized(f"{what}: this route needs {need} as {how}")
        challenge = b'Bearer error="invalid_token"' if had_token else b"Bearer"
        await _send_error(scope, send, err, [
                (b"www-authenticate", challenge),
                # A wrong key stays wrong: Claude Code retries a 401 (it may refresh a key
                # or token) unless told not to, and without this it kept retrying (silent
                # for minutes); it and the Anthropic and OpenAI SDKs read `x-should-retry`
                # before their status rules (Claude Code 2.1.197's retry predicate;
                # anthropic-sdk `_should_retry`, openai-python `_should_retry`).
                (b"x-should-retry", b"false"),
            ])


async def _to_login(scope: Scope, send: Send) -> None:
    """A viewer page loaded without a credential: to the login page, which comes back
    here, query string and all (the list's filters live in it)."""
    back = scope["path"]
    if query := scope.get("query_string", b"").decode("latin-1"):
        back += "?" + query
    back = urllib.parse.quote(back, safe="/")
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", f"/ui/login?next={back}".encode()), (b"content-length", b"0"),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": b""})


async def _send_error(scope: Scope, send: Send, err: ServiceError, headers: list[tuple[bytes, bytes]]) -> None:
    """`err` in the client's own shape (as every other error), counted."""
    ctx = getattr(scope["app"].state, "ctx", None)
    if ctx is not None:
        ctx.metrics.errors_total.labels(type=err.type).inc()
    body = orjson.dumps(error_body(scope["path"], err))
    if err.retry_after_s is not None:
        headers = [*headers, (b"retry-after", str(err.retry_after_s).encode())]
    await send({
        "type": "http.response.start",
        "status": err.status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *headers],
    })
    await send({"type": "http.response.body", "body": body})


def install_auth(app: Any, admin_token: str | None) -> None:
    """Turn auth on for `app` when an admin token is configured (off by default)."""
    if admin_token is None:
        return
    if not admin_token.strip():
        raise ValueError("the admin token must not be empty")
    app.add_middleware(BearerAuth, admin_token=admin_token)
