"""The reply worker: a process of `serve` that decodes large engine replies and, for the
requests whose replies it expects to be large, makes the request itself.

Why: a ~1.4 MB reply (routed experts as nested float lists) costs the event loop far
more than its decode. Read by `serve`, it arrives in a few 256 KiB reads, is joined,
handed to a decoder over a pipe, and its bytes and the threads that move them compete
with the loop for the GIL: under 64 concurrent chats of such replies `/health` p99 was
20-30 ms against 9-16 ms for the same chats with small replies (bench/README.md). Here
the reply never enters `serve`: this process posts the request with its own aiohttp
client, parses the reply (routed experts narrowed, `routed.predecode`) and sends back
only the parsed result, a few KB. Replies that turn out large in `serve` anyway (the
first of their kind) come here as bytes to be parsed, and a streamed turn's large
routed-experts payload (its frames are parsed on `serve`'s threads) to be decoded.

**Protocol** (a stream socket pair, one per worker). Each frame is a header `<IIB`
(the payload's length, the request id, a code) and a pickled payload; a payload that
does not unpickle fails only its own request. `serve` -> worker, by code:
`CALL (fn, args, kwargs)` runs `fn(*args, **kwargs)` here (the reply parsers);
`FETCH (client, base_url, path, body, headers, deadline, retries, limits, parse,
parse_kw)` posts `body` on `client`'s session (one per engine client of `serve`) and
parses a 200 reply with `parse(body, **parse_kw)` (`deadline` is on `time.monotonic()`'s
clock, which both processes share); `CANCEL` (no payload) gives
up a fetch (its connection is closed, which is how the engine learns of it; nothing is
answered); `FORGET client` closes that session once its client closed for good
(nothing answered). Worker -> `serve`: code `OK` and the result, or `FAILED` and the exception
to raise (a `ServiceError` keeps its attributes across pickling, `__reduce__`; any
other exception is a bug and comes back as `InternalInvariant` naming it, the 500 it
would be in `serve`); request id 0 once, when
the worker is ready. A fetch's result is `http.Fetched`: the status, the reply's size,
and the parsed result (or the whole `HTTPReply` when not 200).

Both ends are trusted code of the same package: pickle is fine here and only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pickle
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from trajectory.errors import ValidationError

from ..child_process import ignore_interrupts
from ..errors import InternalInvariant, ServiceError, UpstreamInvalid, UpstreamTransportError
from ..malloc_tuning import retain_large_blocks
from ..routed import predecode
from .base import GenerateResult
from .http import ConnectionLimits, Fetched, make_session, request_bytes, retry_transient

__all__ = ["CALL", "CANCEL", "FAILED", "FETCH", "FORGET", "HEAD", "OK", "READY", "frame", "main", "predecoded", "read_frame"]

CALL, FETCH, CANCEL, FORGET = 0, 1, 2, 3  # serve -> worker
OK, FAILED = 0, 1  # worker -> serve
READY = 0  # the request id of the worker's first answer
HEAD = struct.Struct("<IIB")  # payload length, request id, code
READ_LIMIT = 4 * 1024 * 1024  # a stream reader's buffer: a large frame arrives in few reads


def frame(rid: int, code: int, obj: object = None) -> list[bytes]:
    """One frame as the header and the pickled payload (raises what does not pickle:
    nothing is sent then), as two pieces for `writelines` (uvloop sends them without
    joining)."""
    data = pickle.dumps(obj, protocol=5)
    return [HEAD.pack(len(data), rid, code), data]


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """The next frame: its request id, its code and its payload, still pickled."""
    n, rid, code = HEAD.unpack(await reader.readexactly(HEAD.size))
    return rid, code, await reader.readexactly(n)


def predecoded(result: Any) -> Any:
    """A `GenerateResult` with its base64 routed experts as narrowed ids (`predecode`)."""
    if isinstance(result, GenerateResult) and isinstance(result.routed_experts, bytes):
        return dataclasses.replace(result, routed_experts=predecode(result.routed_experts))
    return result


class _Worker:
    def __init__(self, out: asyncio.StreamWriter) -> None:
        self.out = out
        self.fetches: dict[int, asyncio.Task[None]] = {}
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.closing: set[asyncio.Task[None]] = set()
        self.forgotten: set[str] = set()  # clients closed for good (ids are never reused)

    def handle(self, rid: int, op: int, data: bytes) -> None:
        if op == CANCEL:
            if (given_up := self.fetches.pop(rid, None)) is not None:
                given_up.cancel()
            return
        try:
            payload = pickle.loads(data)
            if op == FORGET:
                self.forgotten.add(payload)
                if (gone := self.sessions.pop(payload, None)) is not None:
                    task = asyncio.create_task(gone.close())
                    self.closing.add(task)
                    task.add_done_callback(self.closing.discard)
                return
            if op == CALL:
                fn, args, kwargs = payload
                self.answer(rid, OK, predecoded(fn(*args, **kwargs)))
        except Exception as exc:  # the parser's verdict (UpstreamInvalid) goes back as it is
            self.answer(rid, FAILED, exc)
            return
        if op == FETCH:
            # its session taken now, in frame order: a FORGET read with it in one piece
            # must not leave a session made after it, which nothing would close
            client, limits = payload[0], payload[7]
            if client in self.forgotten:
                self.answer(rid, FAILED, UpstreamTransportError(f"{payload[1]}: engine client is closed",
                                                               engine=payload[1], transient=False))
                return
            task = asyncio.create_task(self.fetch(rid, self.session(client, limits), *payload[1:]))
            self.fetches[rid] = task
            task.add_done_callback(lambda _t: self._forget(rid))

    def _forget(self, rid: int) -> None:
        self.fetches.pop(rid, None)

    def answer(self, rid: int, code: int, value: Any) -> None:
        if isinstance(value, ValidationError):  # bad engine output, as the turn pipeline maps it
            value = UpstreamInvalid(str(value))
        elif code == FAILED and not isinstance(value, ServiceError):  # a bug, as it would be in serve: a 500
            value = InternalInvariant(f"the reply worker failed on it: {type(value).__name__}: {value}")
        try:
            pieces = frame(rid, code, value)
        except Exception as exc:  # noqa: BLE001 - a result holding something that does not pickle
            pieces = frame(rid, FAILED, InternalInvariant(
                f"the reply worker could not send back {type(value).__name__}: {type(exc).__name__}: {exc}"))
        self.out.writelines(pieces)

    def session(self, client: str, limits: ConnectionLimits) -> aiohttp.ClientSession:
        if (s := self.sessions.get(client)) is None:
            s = self.sessions[client] = make_session(limits)
        return s

    async def fetch(self, rid: int, session: aiohttp.ClientSession, base_url: str, path: str, body: bytes,
                    headers: dict[str, str] | None, deadline: float, retries: int, limits: ConnectionLimits, parse: Callable[..., Any],
                    parse_kw: dict[str, Any]) -> None:
        """`EngineHTTP._send`'s request and retries, then the parse, here."""

        async def once() -> Any:
            return await request_bytes(session, "POST", base_url + path, engine=base_url, body=body,
                                       headers=headers, timeout_s=max(0.001, deadline - time.monotonic()))

        try:
            reply = await retry_transient(once, retries=retries)
            if reply.status != 200:
                self.answer(rid, OK, Fetched(reply.status, len(reply.body), reply))
                return
            self.answer(rid, OK, Fetched(200, len(reply.body), predecoded(parse(reply.body, **parse_kw))))
        except asyncio.CancelledError:
            raise  # `serve` gave up on it: nobody waits for an answer
        except Exception as exc:
            self.answer(rid, FAILED, exc)

    async def close(self) -> None:
        for task in list(self.fetches.values()):
            task.cancel()
        for s in self.sessions.values():
            await s.close()


async def serve(sock: socket.socket) -> None:
    """Answer frames until `serve` closes its end."""
    reader, out = await asyncio.open_connection(sock=sock, limit=READ_LIMIT)
    worker = _Worker(out)
    out.writelines(frame(READY, OK))
    try:
        while True:
            worker.handle(*await read_frame(reader))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # `serve` closed its end (or is gone): nothing more to answer
    finally:
        await worker.close()
        with contextlib.suppress(ConnectionError):
            out.close()


def main(argv: list[str]) -> int:
    """`python -m session_server.engines.reply_worker FD PARENT_PID MALLOC_RETAIN_MB`. Run
    by `ReplyDecoder.start`, never by hand."""
    from ..parent_death import die_with_parent

    fd, parent, retain_mb = argv
    ignore_interrupts()
    die_with_parent(int(parent))
    retain_large_blocks(int(retain_mb))  # it allocates every large reply, as `serve` did (malloc_tuning.py)
    sock = socket.socket(fileno=int(fd))
    try:  # serve's own loop is uvloop where installed; the worker's too
        import uvloop
    except ImportError:
        asyncio.run(serve(sock))
        return 0
    if hasattr(uvloop, "run"):  # 0.18 and later
        uvloop.run(serve(sock))
    else:
        uvloop.install()
        asyncio.run(serve(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
