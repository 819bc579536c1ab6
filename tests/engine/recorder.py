"""A recording HTTP proxy between the session server and a real engine: the ground truth
of what the engine saw and sampled, to compare the committed trajectory with.

Every request is forwarded as is (streams chunk by chunk, so the session server sees the
engine's own timing); generation requests and their replies are kept in order. A test that
must land an event while the engine samples paces it (`Recorder.paced`), and one that needs
the same text across a pause scripts it (`Recorder.scripted`): the proxy adds the knob to
each generation request's vLLM `extra_args` on the way (the record keeps what the session
server sent), and the engine's plugins (`plugins/`) act on it. A client that hangs up
cancels the handler, which closes the upstream connection: the engine sees the
disconnect exactly as it would from the session server itself.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from session_server.ops.harness import free_port

__all__ = ["PACE_MS", "Exchange", "Recorder", "recording_proxy"]

# The engine step floor the suite paces with: about 3x a step of the tiny Qwen3 here (4 ms),
# so a 400-token request runs 4 s or more on any machine and 6 s here.
PACE_MS = 10.0

GENERATE_PATHS = ("/inference/v1/generate", "/v1/completions", "/generate")
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


@dataclass
class Exchange:
    """One generation request and the engine's reply."""

    path: str
    request: dict[str, Any]
    status: int = 0
    raw: bytearray = field(default_factory=bytearray)  # recorded before forwarded: the reader never sees more
    done: bool = False  # the reply was read to its end (False: the client hung up first)

    @property
    def body(self) -> bytes:
        return bytes(self.raw)

    @property
    def received(self) -> int:
        """Reply bytes forwarded so far (a stream's grow as tokens are sampled)."""
        return len(self.raw)

    @property
    def stream(self) -> bool:
        return bool(self.request.get("stream"))

    def reply(self) -> dict[str, Any]:
        """The reply as one body: a non-streamed JSON, or a stream's frames folded (ids and
        logprob entries concatenated, the last frame's finish reason and version spans)."""
        if not self.stream:
            return dict(json.loads(self.body))
        ids: list[int] = []
        content: list[Any] = []
        choice: dict[str, Any] = {}
        # a stream the session server cut (a hang-up, a stop it matched itself) can end
        # inside a frame: only the lines the engine finished are read
        for line in self.body.decode(errors="replace").split("\n")[:-1]:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            for c in frame.get("choices") or []:
                ids.extend(c.get("token_ids") or [])
                lp = c.get("logprobs")
                content.extend((lp or {}).get("content") or [])
                choice.update({k: v for k, v in c.items() if v is not None and k not in ("token_ids", "logprobs")})
        return {"choices": [{**choice, "token_ids": ids, "logprobs": {"content": content}}]}

    def finished(self) -> bool:
        """The engine's reply so far carries a finish reason: the session server had all of
        it (the proxy may not have seen the upstream's end yet)."""
        try:
            return self.reply()["choices"][0].get("finish_reason") is not None
        except (ValueError, KeyError, IndexError):
            return False

    def sampled(self) -> tuple[list[int], list[float]]:
        choice = self.reply()["choices"][0]
        return list(choice["token_ids"]), [e["logprob"] for e in choice["logprobs"]["content"]]


@dataclass
class Recorder:
    """The proxy's URL and what it saw."""

    url: str
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request
    # vLLM `extra_args` added to each generation request sent from now (the plugins' knobs)
    extra_args: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def _with(self, **args: Any) -> Iterator[None]:
        self.extra_args.update(args)
        try:
            yield
        finally:
            for k in args:
                self.extra_args.pop(k, None)

    def paced(self, ms: float) -> contextlib.AbstractContextManager[None]:
        """Generation requests sent inside the block run at most one token per `ms` at the
        engine: a floor on how long they take on any machine, however fast."""
        return self._with(pace_ms=ms)

    def scripted(self, ids: list[int]) -> contextlib.AbstractContextManager[None]:
        """Generation requests sent inside the block sample `ids` from the end of the first
        one's prompt: a resubmission (`prompt + partial`) goes on where its partial ended."""
        return self._with(script=list(ids), script_start=None)

    def forwarded(self, path: str, raw: bytes) -> bytes:
        """The body to send upstream: `raw`, with the plugins' knobs added to a generation request."""
        if not self.extra_args or path not in GENERATE_PATHS or not raw:
            return raw
        body = json.loads(raw)
        if self.extra_args.get("script_start", 0) is None:  # the script starts after this prompt
            self.extra_args["script_start"] = len(body.get("token_ids") or body.get("prompt") or [])
        if path == "/inference/v1/generate":
            params = body.setdefault("sampling_params", {})
            params["extra_args"] = {**(params.get("extra_args") or {}), **self.extra_args}
        elif path == "/v1/completions":
            body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), **self.extra_args}
        return json.dumps(body).encode()

    def generations(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path in GENERATE_PATHS]

    def clear(self) -> None:
        self.exchanges.clear()
        self.calls.clear()


@contextlib.asynccontextmanager
async def recording_proxy(upstream: str) -> AsyncIterator[Recorder]:
    """Serve a recording proxy to `upstream` on a free 127.0.0.1 port until the block exits."""
    rec = Recorder(url="", upstream=upstream)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rec.calls.append((request.method, request.path))
        ex: Exchange | None = None
        if request.method == "POST" and request.path in GENERATE_PATHS:
            ex = Exchange(path=request.path, request=json.loads(raw) if raw else {})
            rec.exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = rec.forwarded(request.path, raw) if request.method == "POST" else raw
        async with session.request(request.method, upstream + request.path_qs, data=body, headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in _HOP})
            if ex is not None:
                ex.status = up.status
            await resp.prepare(request)
            # Each chunk is recorded before it is forwarded: the session server can commit a
            # turn (and a test read the record) as soon as the last chunk reaches it, while
            # this handler still waits on the write.
            async for chunk in up.content.iter_any():
                if ex is not None:
                    ex.raw.extend(chunk)
                await resp.write(chunk)
            if ex is not None:
                ex.done = True
            await resp.write_eof()
            return resp

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    rec.url = f"http://127.0.0.1:{port}"
    try:
        yield rec
    finally:
        await runner.cleanup()
        await session.close()
