"""Shared HTTP plumbing for the engine adapters (the engine data plane).

Owns: the aiohttp session/connector factory (a per-engine connection cap and a
keep-alive shorter than the engine's, so we never reuse a socket the engine is
about to close), the one place where aiohttp exceptions become
`session_server.errors` engine errors, the retry-with-backoff-and-jitter helper
for transient failures, and `raise_nofile_limit` for start-up.

Error mapping (`request_bytes`):

    aiohttp ServerTimeoutError / asyncio.TimeoutError -> UpstreamTimeout
    aiohttp ClientConnectorError (connect refused, DNS) -> UpstreamTransportError(transient=True)
        nothing was sent, so a retry cannot duplicate work
    ServerDisconnectedError, ClientOSError (reset), ClientPayloadError
                                                      -> UpstreamTransportError(transient=False)
        the request may have reached the engine and produced tokens
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar, cast

import aiohttp
import msgspec
import orjson

from session_server.engines.streams import STREAM_FRAME_MAX, Offload, sse_lines
from session_server.errors import (
    UpstreamHTTPError,
    UpstreamInvalid,
    UpstreamTimeout,
    UpstreamTransportError,
)

T = TypeVar("T")
_CLIENT_IDS = itertools.count(1)

# uvicorn (SGLang and vLLM both serve through it) closes idle keep-alive
# connections after 5 s; closing ours earlier avoids the reuse-after-close race.
ENGINE_KEEPALIVE_S = 5.0


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-engine connection settings."""

    max_connections: int = 256 + 8  # generate cap plus headroom for the control plane
    keepalive_s: float = ENGINE_KEEPALIVE_S - 1.0
    connect_timeout_s: float = 10.0


READ_BUFSIZE = 4 * 1024 * 1024


def make_session(limits: ConnectionLimits | None = None) -> aiohttp.ClientSession:
    """One pooled aiohttp session per engine; must be called inside a running loop."""
    limits = limits or ConnectionLimits()
    connector = aiohttp.TCPConnector(
        limit=limits.max_connections,
        limit_per_host=0,
        keepalive_timeout=limits.keepalive_s,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=limits.connect_timeout_s),
        auto_decompress=True,
        raise_for_status=False,
        # engine replies can be ~1.4 MB (routed experts): a large read buffer lets a
        # body arrive in few loop wake-ups instead of pausing the socket every 64 KiB
        read_bufsize=READ_BUFSIZE,
    )


@dataclass(frozen=True)
class HTTPReply:
    status: int
    body: bytes
    content_type: str


@dataclass(frozen=True)
class Fetched:
    """A generation request's outcome, wherever it was made: the status, the reply's
    size in bytes, and the parsed result (the `HTTPReply` itself when not 200)."""

    status: int
    size: int
    value: Any


class RemoteFetch(Protocol):
    """Makes a generation request in another process, returns it parsed (None: made here instead)."""

    large_reply_bytes: int

    async def fetch(self, client: str, base_url: str, path: str, body: bytes, *, headers: Mapping[str, str] | None,
                    timeout_s: float, retries: int, limits: ConnectionLimits, parse: Callable[..., Any],
                    parse_kw: dict[str, Any]) -> Fetched | None: ...

    def forget(self, client: str) -> None: ...


async def request_bytes(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    engine: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    params: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> HTTPReply:
    """Send one request and read the whole body, translating aiohttp errors at the boundary."""
    hdrs = dict(headers or {})
    if body is not None:
        hdrs.setdefault("Content-Type", "application/json")
    timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
    with translate_errors(method, url, engine=engine, timeout_s=timeout_s):
        async with session.request(
            method, url, data=body, headers=hdrs, params=params, timeout=timeout
        ) as resp:
            data = await resp.read()
            return HTTPReply(resp.status, data, resp.content_type)


@contextlib.contextmanager
def translate_errors(method: str, url: str, *, engine: str, timeout_s: float | None) -> Iterator[None]:
    """aiohttp's exceptions as `session_server.errors` engine errors (the module doc's table)."""
    try:
        yield
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"{method} {url}: no answer within {timeout_s} s", engine=engine) from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamTransportError(
            f"{method} {url}: cannot connect: {exc}", engine=engine, transient=True
        ) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise UpstreamTransportError(
            f"{method} {url}: engine closed the connection: {exc}", engine=engine, transient=False
        ) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamTransportError(
            f"{method} {url}: {type(exc).__name__}: {exc}", engine=engine, transient=False
        ) from exc


async def retry_transient(
    op: Callable[[], Awaitable[T]],
    *,
    retries: int,
    base_delay_s: float = 0.05,
    max_delay_s: float = 2.0,
    rng: random.Random | None = None,
) -> T:
    """Run `op`, retrying only `UpstreamTransportError(transient=True)` with exponential
    backoff and full jitter (so a restarted engine is not hit by a synchronized herd).
    The default generator is `random`'s own (reseeded in a forked child): seeding a new
    one from the OS on every call cost more than the rest of a small request's bookkeeping."""
    uniform = rng.uniform if rng is not None else random.uniform
    attempt = 0
    while True:
        try:
            return await op()
        except UpstreamTransportError as exc:
            if not exc.transient or attempt >= retries:
                raise
            cap = min(max_delay_s, base_delay_s * (2**attempt))
            attempt += 1
            await asyncio.sleep(uniform(0.0, cap))


def raise_nofile_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; 10K agents plus engine
    sockets exhaust the usual 1024. Returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            # Some platforms cap below the reported hard limit; keep what we have.
            return soft, hard
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def encode_json(payload: Any) -> bytes:
    """Request bodies: orjson serialises numpy id arrays natively, so the context
    (up to 100K+ ids) is never turned into Python ints on the event loop."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def raw_or_none(raw: msgspec.Raw) -> bytes | None:
    """A raw JSON value's bytes, None when absent or `null`: payloads such as routed
    experts are stored as the engine sent them, never decoded here."""
    data = bytes(raw)
    return None if data in (b"", b"null") else data


def http_error(reply: HTTPReply, *, what: str, engine: str) -> UpstreamHTTPError:
    """An engine's non-200 answer as a typed error; both engines' error bodies
    (`{"error": {"message"}}`, `{"error": "..."}`, `{"message": ...}`, text) read."""
    message = reply.body[:500].decode(errors="replace")
    try:
        decoded = msgspec.json.decode(reply.body)
        if isinstance(decoded, dict):
            err = decoded.get("error", decoded.get("message", decoded))
            message = str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except msgspec.DecodeError:
        pass
    return UpstreamHTTPError(f"{what}: HTTP {reply.status}: {message}", engine=engine, http_status=reply.status)


class EngineHTTP:
    """The HTTP side every adapter shares: one pooled session, the per-engine
    concurrency cap, deadlines measured from dispatch, retries of transient
    errors, control-plane calls and the health check. Adapters own the wire format."""

    def __init__(
        self,
        base_url: str,
        *,
        protocol: str,
        max_concurrency: int = 256,
        limits: ConnectionLimits | None = None,
        retries: int = 2,
        control_timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.protocol = protocol
        self.max_concurrency = max_concurrency
        self.retries = retries
        self.control_timeout_s = control_timeout_s
        self._limits = limits or ConnectionLimits(max_connections=max_concurrency + 8)
        self._sem = asyncio.Semaphore(max_concurrency)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # the last 200 reply's size per kind of generation (`generate`'s path and parse)
        self._reply_bytes: dict[tuple[Any, ...], int] = {}
        self._fetches: set[asyncio.Future[Fetched | None]] = set()  # requests the reply worker makes now
        self._remote_used: RemoteFetch | None = None  # told to forget this client on `aclose`
        self._client_id = f"{self.base_url}#{next(_CLIENT_IDS)}"  # its session in the reply worker

    @property
    def closed(self) -> bool:
        return self._closed

    def session(self) -> aiohttp.ClientSession:
        if self._closed:  # a closed client never reopens a session nobody would close
            raise UpstreamTransportError(f"{self.base_url}: engine client is closed",
                                         engine=self.base_url, transient=False)
        if self._session is None:
            self._session = make_session(self._limits)
        return self._session

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the engine's concurrency slots. A caller that must read state which
        may change while it queues (the pause gate, the weight version and its cache salt)
        takes the slot first, reads the state, then sends with `slot_held=True`."""
        async with self._sem:
            yield

    async def generate(
        self, path: str, body: bytes, parse: Callable[..., T], *, what: str, timeout_s: float,
        headers: Mapping[str, str] | None = None, slot_held: bool = False, offload: Offload,
        remote: RemoteFetch | None = None, parse_kw: dict[str, Any] | None = None,
    ) -> T:
        """POST a generation under the concurrency cap (unless the caller holds a slot; the
        deadline starts once a slot is held) and parse a 200 reply with `parse(body,
        **parse_kw)`; another status is its typed error (`http_error`, named `what`).

        Where: when the last reply to a request of this kind (`path` and `parse`) was at
        least `remote.large_reply_bytes`, `remote` makes the request and parses the reply in
        its own process, so the large body never enters this one (reply_worker.py says
        why); otherwise it is made here and parsed by `offload` (which sends a large reply
        to the worker as bytes). A new kind starts here; each 200 reply's size is learnt
        (a `partial` parser is its kind by function and arguments). In the worker the parse
        runs while the slot is held (one answer); here, after the slot is given back."""
        kw = parse_kw or {}
        kind = (path, parse.func, parse.args) if isinstance(parse, partial) else (path, parse)
        fetched: Fetched | None = None
        self._in_flight += 1
        self._idle.clear()
        try:
            async with contextlib.nullcontext() if slot_held else self._sem:
                if remote is not None and self._reply_bytes.get(kind, 0) >= remote.large_reply_bytes:
                    self.session()  # closed: refused, as here
                    self._remote_used = remote
                    fetched = await self._remote(remote.fetch(
                        self._client_id, self.base_url, path, body, headers=headers, timeout_s=timeout_s, retries=self.retries,
                        limits=self._limits, parse=parse, parse_kw=kw))
                if fetched is None:
                    reply = await self._send(path, body, timeout_s=timeout_s, headers=headers)
                    fetched = Fetched(reply.status, len(reply.body), reply)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        if fetched.status != 200:
            raise http_error(fetched.value, what=what, engine=self.base_url)
        self._reply_bytes[kind] = fetched.size  # an error's body says nothing of the kind's size
        if isinstance(fetched.value, HTTPReply):
            return cast(T, await offload(parse, fetched.value.body, **kw))
        return cast(T, fetched.value)

    async def _remote(self, fetch: Awaitable[Fetched | None]) -> Fetched | None:
        """A request the reply worker makes, ended by `aclose` as one made here would be."""
        task = asyncio.ensure_future(fetch)
        self._fetches.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed and task.cancelled() and (current is None or not current.cancelling()):
                raise UpstreamTransportError(f"{self.base_url}: engine client closed during the request",
                                             engine=self.base_url, transient=False) from None
            raise
        finally:
            self._fetches.discard(task)

    async def stream(
        self, path: str, body: bytes, *, timeout_s: float, headers: Mapping[str, str] | None = None,
        slot_held: bool = False,
    ) -> AsyncIterator[bytes]:
        """POST a streamed generation (SSE) under the concurrency cap, as `generate`; yields
        each `data:` payload as it arrives (`[DONE]` included). A transient connect error
        (nothing was sent, so nothing sampled or shown) is retried as `generate` retries it,
        within the same deadline; once connected, nothing is retried: a stream that started
        may have produced tokens. A non-200 answer raises its typed error."""
        self._in_flight += 1
        self._idle.clear()
        url = self.base_url + path
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        deadline = time.monotonic() + timeout_s

        async def connect() -> aiohttp.ClientResponse:
            with translate_errors("POST", url, engine=self.base_url, timeout_s=timeout_s):
                return await self.session().post(url, data=body, headers=hdrs, timeout=aiohttp.ClientTimeout(
                    total=max(0.001, deadline - time.monotonic())))

        try:
            async with contextlib.AsyncExitStack() as stack:
                if not slot_held:
                    await stack.enter_async_context(self._sem)
                resp = await stack.enter_async_context(await retry_transient(connect, retries=self.retries))
                with translate_errors("POST", url, engine=self.base_url, timeout_s=timeout_s):
                    if resp.status != 200:
                        reply = HTTPReply(resp.status, await resp.read(), resp.content_type)
                        raise http_error(reply, what=f"{self.protocol} {path}", engine=self.base_url)
                    try:
                        async for line in sse_lines(resp.content.iter_any(), STREAM_FRAME_MAX):
                            line = line.strip()
                            if line.startswith(b"data:"):
                                yield line[5:].strip()
                    except ValueError as exc:  # a line over STREAM_FRAME_MAX
                        raise UpstreamInvalid(f"POST {url}: stream frame too large: {exc}",
                                              engine=self.base_url) from exc
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _send(self, path: str, body: bytes, *, timeout_s: float, headers: Mapping[str, str] | None) -> HTTPReply:
        deadline = time.monotonic() + timeout_s

        async def once() -> HTTPReply:
            return await request_bytes(
                self.session(), "POST", self.base_url + path, engine=self.base_url, body=body,
                headers=headers, timeout_s=max(0.001, deadline - time.monotonic()),
            )

        return await retry_transient(once, retries=self.retries)

    async def call(
        self, method: str, path: str, body: Any = None, *,
        params: Mapping[str, str] | None = None, timeout_s: float | None = None,
    ) -> HTTPReply:
        """A control-plane request (not under the generation cap)."""
        data = None if body is None else encode_json(body)

        async def once() -> HTTPReply:
            return await request_bytes(
                self.session(), method, self.base_url + path, engine=self.base_url, body=data,
                params=params, timeout_s=timeout_s or self.control_timeout_s,
            )

        return await retry_transient(once, retries=self.retries)

    async def call_json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """`call`, then a 200 decoded as JSON (text when not JSON, None when empty)."""
        reply = await self.call(method, path, body, **kw)
        if reply.status != 200:
            raise http_error(reply, what=f"{self.protocol} {path}", engine=self.base_url)
        if not reply.body:
            return None
        try:
            return msgspec.json.decode(reply.body)
        except msgspec.DecodeError:
            return reply.body.decode(errors="replace")

    async def set_version(self, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /update_weight_version` (vLLM 0.32 dev mode and SGLang both have it, with
        `new_version`): what the engine reports from now on. 404/405: this engine has no
        such endpoint (`pushed: false`; the trainer's version is still stamped, at dispatch)."""
        # short: the trainer waits for this answer while its engines are paused
        reply = await self.call("POST", "/update_weight_version", body, timeout_s=5.0)
        if reply.status in (404, 405):
            return {"pushed": False, "reason": f"the engine answered {reply.status} to /update_weight_version"}
        if reply.status != 200:
            raise http_error(reply, what=f"{self.protocol} /update_weight_version", engine=self.base_url)
        return {"pushed": True}

    async def health(self) -> bool:
        """GET /health: 200 when serving; anything else, or no answer, is unhealthy."""
        try:
            reply = await self.call("GET", "/health", timeout_s=5.0)
        except Exception:  # a health check answers a bool, never raises
            return False
        return reply.status == 200

    async def aclose(self, drain_s: float = 0.0) -> None:
        """Close for good. With `drain_s`, generations already in flight may finish first
        (an engine removed mid-turn still delivers that turn); new ones are refused."""
        self._closed = True
        if drain_s > 0 and self._in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_s)
        fetches = list(self._fetches)  # ended as closing the session ends those made here,
        for fetch in fetches:  # their CANCELs sent before the FORGET
            fetch.cancel()
        await asyncio.gather(*fetches, return_exceptions=True)
        if self._remote_used is not None:
            self._remote_used.forget(self._client_id)
        if self._session is not None:
            await self._session.close()
            self._session = None
