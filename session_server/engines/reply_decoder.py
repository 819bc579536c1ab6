"""Where engine replies are decoded: threads for small ones, a worker process for large
ones, and the worker fetches the replies it expects to be large itself.

A ~1.4 MB reply (routed experts as nested float lists) takes msgspec 2.5-6 ms to
decode on this machine, one C call that holds the GIL throughout. In a thread that
still stalls the event loop thread, which can only run in the gaps between such calls.
A worker process has its own GIL. Better still, it makes the request itself once a kind
of generation is known to answer large (`EngineHTTP.generate`, `fetch` here): then the
reply never enters `serve` at all, only its parsed result does (reply_worker.py has the
numbers). Small replies stay on the offload threads (inline when tiny), where the
hand-off costs more than the decode.

Routing replay (R3): a large reply's base64 routed experts are decoded in the worker
(`session_server.routed.predecode`), so only the narrowed ids cross back (2 MB instead
of 10.5 MB at 4K positions x 60 layers x top-8) and the main process never runs the
GIL-holding base64 decode. A streamed turn's result is folded on the threads (its fold
lives here); its payload, when large, makes one more trip to the worker for the same
decode.

A worker that dies fails what it had in flight (`ReplyWorkerLost`, a 503: nothing is
committed, and no engine is blamed for it) and is started again on the first large
reply a second or more later; meanwhile its work runs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..child_process import spawn
from ..errors import ReplyWorkerLost, UpstreamInvalid
from ..malloc_tuning import MAX_RETAIN_MB
from ..offload import CpuOffload
from ..routed import predecode
from .base import GenerateResult
from .http import ConnectionLimits, Fetched
from .reply_worker import CALL, CANCEL, FETCH, FORGET, OK, READ_LIMIT, READY, frame, read_frame

__all__ = ["LARGE_REPLY_BYTES", "ReplyDecoder"]

LARGE_REPLY_BYTES = 256 * 1024
START_TIMEOUT_S = 60.0
RESTART_AFTER_S = 1.0
CALL_TIMEOUT_S = 60.0
ANSWER_GRACE_S = 5.0  # past a fetch's deadline, how long its worker gets to send the timeout it found

log = logging.getLogger("session_server")


class _Worker:
    """One worker process and `serve`'s end of its socket: requests by id, answers read
    by a task on the loop."""

    def __init__(self, malloc_retain_mb: int) -> None:
        self.malloc_retain_mb = malloc_retain_mb
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.alive = False  # its socket is open (answers may still arrive)
        self.ready = False  # alive and said so: requests go to it
        self.started = False  # once started, a dead worker is started again (`ReplyDecoder._worker`)
        self.restarting = False
        self.closing = False
        self.ended_at = 0.0
        self.proc: subprocess.Popen[bytes] | None = None
        self._ids = itertools.cycle(range(1, 1 << 32))  # the header's uint32; 0 is READY
        self._out: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.started = True
        await self._reap()
        mine, theirs = socket.socketpair()
        try:
            with theirs:
                self.proc = spawn(__name__.rpartition(".")[0] + ".reply_worker",
                                  [str(theirs.fileno()), str(os.getpid()), str(self.malloc_retain_mb)],
                                  pass_fds=(theirs.fileno(),))
            reader, self._out = await asyncio.open_connection(sock=mine, limit=READ_LIMIT)
        except BaseException:
            mine.close()
            self.kill()
            raise
        ready = asyncio.get_running_loop().create_future()
        self.pending[READY] = ready
        self.alive = True
        self._reading = asyncio.create_task(self._read(reader), name="tito-reply-worker")
        try:
            await asyncio.wait_for(ready, START_TIMEOUT_S)
        except BaseException:
            self._ended("the reply worker did not start")
            raise
        self.ready = not self.closing

    async def ask(self, code: int, payload: Any) -> Any:
        """Send one request; its answer (or its exception, raised)."""
        rid = next(self._ids)
        pieces = frame(rid, code, payload)  # an unpicklable payload raises here: nothing sent
        if not self.alive or self.closing or self._out is None:
            raise ReplyWorkerLost("the reply worker process is not running")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self._out.writelines(pieces)
        try:
            return await fut
        except asyncio.CancelledError:
            if self.pending.pop(rid, None) is not None and self.alive and not self.closing and code == FETCH:
                self._out.writelines(frame(rid, CANCEL))  # the worker drops the request
            raise

    def tell(self, code: int, payload: Any) -> None:
        """A request that is not answered."""
        if self.alive and not self.closing and self._out is not None:
            self._out.writelines(frame(next(self._ids), code, payload))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why = "the reply worker process ended"
        try:
            while True:
                rid, code, data = await read_frame(reader)
                fut = self.pending.pop(rid, None)
                if fut is None or fut.done():
                    continue  # given up (cancelled) meanwhile
                try:
                    value = pickle.loads(data)
                except Exception as exc:  # noqa: BLE001 - only this answer is lost
                    fut.set_exception(UpstreamInvalid(f"the reply worker's answer could not be read: "
                                                      f"{type(exc).__name__}: {exc}"))
                    continue
                if code == OK:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            why = f"{why} ({type(exc).__name__})"
        finally:
            self._ended(why)

    def _ended(self, why: str) -> None:
        """Whatever was in flight fails (`ReplyWorkerLost`: nothing committed, the engine
        not blamed); the process is killed if it still runs (a broken socket)."""
        if not self.alive:
            return
        self.alive = self.ready = False
        self.ended_at = time.monotonic()
        status = None if self.proc is None else self.proc.poll()
        text = why if status is None else f"{why}, exit status {status}"
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ReplyWorkerLost(f"{text}: the turn's engine request is lost"))
        if self._out is not None:
            self._out.close()
        if self.closing:
            return  # `close` waits for it to exit
        self.kill()
        log.error("%s; %d requests failed; it is started again on the next large reply", text, len(pending))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    async def _reap(self) -> None:
        """A dead worker's exit status collected (no zombie left), off the loop."""
        if self.proc is not None:
            self.kill()
            await asyncio.to_thread(self.proc.wait)

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the worker: it sees its input end and exits (killed after `timeout_s`)."""
        self.closing = True
        self.ready = False
        if self._out is not None and self.alive:
            with contextlib.suppress(OSError, RuntimeError):
                self._out.write_eof()
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
            except TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self._reading is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reading, timeout_s)


class ReplyDecoder:
    """An `Offload` for engine adapters (`await decoder.run(parse_fn, body, **kw)`) and
    their `RemoteFetch` (`decoder.fetch`)."""

    def __init__(self, threads: CpuOffload, *, processes: int = 1, large_reply_bytes: int = LARGE_REPLY_BYTES,
                 malloc_retain_mb: int = 0) -> None:
        """Replies of at least `large_reply_bytes` go to `processes` worker processes;
        the rest to the offload threads (inline when small). `malloc_retain_mb`: the
        workers' `retain_large_blocks` (0: the allocator left as it is)."""
        if not 0 <= malloc_retain_mb <= MAX_RETAIN_MB:
            raise ValueError(f"malloc_retain_mb must be within 0..{MAX_RETAIN_MB}, not {malloc_retain_mb}")
        self._threads = threads
        self.large_reply_bytes = large_reply_bytes
        self.processes = processes
        self._workers = [_Worker(malloc_retain_mb) for _ in range(processes)]
        self._restarts: set[asyncio.Task[None]] = set()
        self._closed = False
        self.fetched = 0  # requests handed to the workers to make

    async def start(self) -> None:
        """Start the workers now (from the event-loop thread), not on the first large reply."""
        await asyncio.gather(*(w.start() for w in self._workers))

    def _worker(self) -> _Worker | None:
        """The live worker with the least in flight; a worker dead for a second is started again."""
        best: _Worker | None = None
        if self._closed:
            return None
        for w in self._workers:
            if w.ready:
                if best is None or len(w.pending) < len(best.pending):
                    best = w
            elif (w.started and not w.alive and not w.restarting
                  and time.monotonic() - w.ended_at >= RESTART_AFTER_S):
                w.restarting = True
                task = asyncio.create_task(self._restart(w))
                self._restarts.add(task)
                task.add_done_callback(self._restarts.discard)
        return best

    async def _restart(self, w: _Worker) -> None:
        try:
            await w.start()
        except Exception as exc:  # noqa: BLE001 - tried again a second later; the threads serve meanwhile
            log.error("the reply worker could not be started again: %s", exc)
            w.ended_at = time.monotonic()
        finally:
            w.restarting = False

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__self__", None) is not None:
            # a bound method (a stream fold's `add` / `result`, engines/streams.py `fold_stream`)
            # keeps its state in this process: a worker process would change only a copy
            return await self._routed_decoded(await self._threads.run(fn, *args, **kwargs))
        body = args[0] if args else None
        size = len(body) if isinstance(body, bytes) else 0
        if size >= self.large_reply_bytes and (w := self._worker()) is not None:
            try:
                return await self._call(w, fn, args, kwargs)
            except ReplyWorkerLost as exc:  # the reply is in hand: parsed here instead
                log.warning("%s; parsing this reply in serve", exc)
        return await self._threads.run_sized(size, fn, *args, **kwargs)

    async def _call(self, w: _Worker, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`fn(*args, **kwargs)` in the worker. A parse takes milliseconds: a worker silent
        for `CALL_TIMEOUT_S` is stuck, and is killed (started again later) rather than
        left to hold every large reply's turn."""
        try:
            return await asyncio.wait_for(w.ask(CALL, (fn, args, kwargs)), CALL_TIMEOUT_S)
        except TimeoutError:
            w.kill()
            raise ReplyWorkerLost(f"the reply worker did not answer a parse within {CALL_TIMEOUT_S:g} s; "
                                  "it is started again") from None

    def forget(self, client: str) -> None:
        """An engine client closed for good: the workers close their session for it."""
        for w in self._workers:
            if w.alive:
                w.tell(FORGET, client)

    async def fetch(self, client: str, base_url: str, path: str, body: bytes, *, headers: Mapping[str, str] | None,
                    timeout_s: float, retries: int, limits: ConnectionLimits, parse: Callable[..., Any],
                    parse_kw: dict[str, Any]) -> Fetched | None:
        """The request made and its reply parsed in a worker (`RemoteFetch`); None when
        no worker is up (the caller makes it itself). The deadline runs from now, here: a
        worker that is slow to read the request (busy parsing) or stuck cannot stretch it."""
        w = self._worker()
        if w is None:
            return None
        self.fetched += 1
        deadline = time.monotonic() + timeout_s
        ask = w.ask(FETCH, (client, base_url, path, body, None if headers is None else dict(headers),
                            deadline, retries, limits, parse, parse_kw))
        try:
            got: Fetched = await asyncio.wait_for(ask, timeout_s + ANSWER_GRACE_S)
        except TimeoutError:
            # its own deadline would have answered by now: the worker is stuck, not the engine
            w.kill()
            raise ReplyWorkerLost(f"the reply worker did not answer POST {base_url}{path} within "
                                  f"{timeout_s + ANSWER_GRACE_S:g} s; it is started again") from None
        return got

    async def _routed_decoded(self, result: Any) -> Any:
        """A streamed result's large routed-experts payload decoded in the worker."""
        raw = result.routed_experts if isinstance(result, GenerateResult) else None
        if not isinstance(raw, bytes) or len(raw) < self.large_reply_bytes or (w := self._worker()) is None:
            return result
        try:
            routed = await self._call(w, predecode, (raw,), {})
        except ReplyWorkerLost as exc:  # the turn's tokens are in hand: `join` decodes the raw payload
            log.warning("%s; its routed experts stay raw", exc)
            return result
        return dataclasses.replace(result, routed_experts=routed)

    async def aclose(self) -> None:
        """End the workers (after the turns that needed them have drained)."""
        self._closed = True
        restarts = list(self._restarts)
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self._workers if w.started))

