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
first of their kind, a streamed turn's last frame) come here as bytes to be parsed.

**Protocol** (a stream socket pair, one per worker). Each frame is a 4-byte
little-endian length and a pickle. `serve` -> worker: `(op, rid, payload)`:
`CALL (fn, args, kwargs)` runs `fn(*args, **kwargs)` here (the reply parsers);
`FETCH (base_url, path, body, headers, timeout_s, retries, limits, parse, parse_kw)`
posts `body` and parses a 200 reply with `parse(body, **parse_kw)`; `CANCEL None` gives
up a fetch (its connection is closed, which is how the engine learns of it; nothing is
answered). Worker -> `serve`: `(rid, ok, value)`: a result, or the exception to raise
(engine errors keep their attributes across pickling, `errors.ServiceError.__reduce__`);
rid 0 once, when the worker is ready. A fetch's value is `http.Fetched`: the status,
the reply's size, and the parsed result (or the whole `HTTPReply` when not 200).

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

from ..child_process import ignore_interrupts
from ..malloc_tuning import retain_large_blocks
from ..routed import predecode
from .base import GenerateResult
from .http import ConnectionLimits, Fetched, make_session, request_bytes, retry_transient

__all__ = ["CALL", "CANCEL", "FETCH", "FRAME", "READY", "frame", "main", "predecoded"]

CALL, FETCH, CANCEL = 0, 1, 2
READY = 0  # the rid of the worker's first answer
FRAME = struct.Struct("<I")
READ_LIMIT = 4 * 1024 * 1024  # a stream reader's buffer: a large frame arrives in few reads


def frame(obj: object) -> bytes:
    """`obj` as one frame (pickle protocol 5: large bytes copied once)."""
    data = pickle.dumps(obj, protocol=5)
    return FRAME.pack(len(data)) + data


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

    def handle(self, op: int, rid: int, payload: Any) -> None:
        if op == CALL:
            fn, args, kwargs = payload
            try:
                self.answer(rid, True, predecoded(fn(*args, **kwargs)))
            except Exception as exc:  # the parser's verdict (UpstreamInvalid) goes back as it is
                self.answer(rid, False, exc)
        elif op == FETCH:
            task = asyncio.create_task(self.fetch(rid, *payload))
            self.fetches[rid] = task
            task.add_done_callback(lambda _t: self._forget(rid))
        elif op == CANCEL:
            if (given_up := self.fetches.pop(rid, None)) is not None:
                given_up.cancel()

    def _forget(self, rid: int) -> None:
        self.fetches.pop(rid, None)

    def answer(self, rid: int, ok: bool, value: Any) -> None:
        try:
            data = frame((rid, ok, value))
        except Exception as exc:  # noqa: BLE001 - e.g. an exception holding something unpicklable
            data = frame((rid, False, RuntimeError(f"the reply worker could not send back {type(value).__name__}: "
                                                   f"{exc}")))
        self.out.write(data)

    def session(self, base_url: str, limits: ConnectionLimits) -> aiohttp.ClientSession:
        if (s := self.sessions.get(base_url)) is None:
            s = self.sessions[base_url] = make_session(limits)
        return s

    async def fetch(self, rid: int, base_url: str, path: str, body: bytes, headers: dict[str, str] | None,
                    timeout_s: float, retries: int, limits: ConnectionLimits, parse: Callable[..., Any],
                    parse_kw: dict[str, Any]) -> None:
        """`EngineHTTP._send`'s request and retries, then the parse, here."""
        deadline = time.monotonic() + timeout_s
        session = self.session(base_url, limits)

        async def once() -> Any:
            return await request_bytes(session, "POST", base_url + path, engine=base_url, body=body,
                                       headers=headers, timeout_s=max(0.001, deadline - time.monotonic()))

        try:
            reply = await retry_transient(once, retries=retries)
            if reply.status != 200:
                self.answer(rid, True, Fetched(reply.status, len(reply.body), reply))
                return
            self.answer(rid, True, Fetched(200, len(reply.body), predecoded(parse(reply.body, **parse_kw))))
        except asyncio.CancelledError:
            raise  # `serve` gave up on it: nobody waits for an answer
        except Exception as exc:
            self.answer(rid, False, exc)

    async def close(self) -> None:
        for task in list(self.fetches.values()):
            task.cancel()
        for s in self.sessions.values():
            await s.close()


async def serve(sock: socket.socket) -> None:
    """Answer frames until `serve` closes its end."""
    reader, out = await asyncio.open_connection(sock=sock, limit=READ_LIMIT)
    worker = _Worker(out)
    out.write(frame((READY, True, None)))
    try:
        while True:
            (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            op, rid, payload = pickle.loads(await reader.readexactly(n))
            worker.handle(op, rid, payload)
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
    try:
        import uvloop
    except ImportError:  # serve's own loop is uvloop where installed; the worker's too
        asyncio.run(serve(sock))
    else:
        uvloop.run(serve(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
