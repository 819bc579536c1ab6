"""Where engine replies are decoded: threads for small ones, a process for large ones.

A ~1.4 MB reply (routed experts as nested float lists) takes msgspec 2.5-6 ms to
decode on this machine, one C call that holds the GIL throughout. In a thread
that still stalls the event loop thread, which can only run in the gaps between
such calls. A worker process has its own GIL: the loop only pays for handing
the bytes over a pipe. Small replies stay on the offload threads (inline when tiny),
where the hand-off costs more than the decode. Measured here (bench/README.md):
even a cheap-to-decode 1.4 MB base64 reply gives a lower /health p99 through
the process than through a thread, at somewhat lower throughput.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from .offload import CpuOffload

LARGE_REPLY_BYTES = 256 * 1024


def _warm() -> bool:
    import session_server.engines  # noqa: F401  (import the parsers once per worker)

    return True


class ReplyDecoder:
    """An `Offload` for engine adapters: `await decoder.run(parse_fn, body, **kw)`."""

    def __init__(self, threads: CpuOffload, *, processes: int = 1, large_reply_bytes: int = LARGE_REPLY_BYTES) -> None:
        """Replies of at least `large_reply_bytes` go to `processes` worker processes;
        the rest to the offload threads (inline when small)."""
        self._threads = threads
        self.large_reply_bytes = large_reply_bytes
        self._procs: ProcessPoolExecutor | None = None
        if processes > 0:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["session_server.engines"])
            self._procs = ProcessPoolExecutor(max_workers=processes, mp_context=ctx)

    async def start(self) -> None:
        """Start the workers now, not on the first large reply."""
        if self._procs is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._procs, _warm)

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__self__", None) is not None:
            # a bound method (a stream fold's `add` / `result`, engines/http.py `fold_stream`)
            # keeps its state in this process: a worker process would change only a copy
            return await self._threads.run(fn, *args, **kwargs)
        body = args[0] if args else None
        size = len(body) if isinstance(body, bytes) else 0
        if self._procs is not None and size >= self.large_reply_bytes:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._procs, functools.partial(fn, *args, **kwargs))
        return await self._threads.run_sized(size, fn, *args, **kwargs)

    def shutdown(self) -> None:
        if self._procs is not None:
            self._procs.shutdown(wait=True, cancel_futures=True)
