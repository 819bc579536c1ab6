"""Where engine replies are decoded: threads for small ones, a process for large ones.

A ~1.4 MB reply (routed experts as nested float lists) takes msgspec 2.5-6 ms to
decode on this machine, one C call that holds the GIL throughout. In a thread
that still stalls the event loop thread, which can only run in the gaps between
such calls. A worker process has its own GIL: the loop only pays for handing
the bytes over a pipe. Small replies stay on the offload threads (inline when tiny),
where the hand-off costs more than the decode. Measured here (bench/README.md):
even a cheap-to-decode 1.4 MB base64 reply gives a lower /health p99 through
the process than through a thread, at somewhat lower throughput.

Routing replay (R3): a large reply's base64 routed experts are decoded in the
worker too (`session_server.routed.predecode`), so only the narrowed ids cross
back (2 MB instead of 10.5 MB at 4K positions x 60 layers x top-8) and the
main process never runs the GIL-holding base64 decode. A streamed turn's result
is folded on the threads (its fold lives here); its payload, when large, makes
one more trip to the worker for the same decode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ..malloc_tuning import MAX_RETAIN_MB, retain_large_blocks
from ..offload import CpuOffload
from ..parent_death import ENV as DIE_WITH_ENV
from ..parent_death import arm_pool_worker
from ..routed import predecode
from .base import GenerateResult

LARGE_REPLY_BYTES = 256 * 1024


def _warm() -> bool:
    import session_server.engines  # noqa: F401  (import the parsers once per worker)

    return True


def _init_worker(owner_pid: int, malloc_retain_mb: int) -> None:
    """A worker dies with its owner and, like `serve`, keeps large blocks in its heap:
    it unpickles and parses every large reply (malloc_tuning.py)."""
    arm_pool_worker(owner_pid)
    retain_large_blocks(malloc_retain_mb)


def _parse(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """In the worker: the reply parsed, its routed experts (if any) decoded."""
    return _predecoded(fn(*args, **kwargs))


def _predecoded(result: Any) -> Any:
    """A `GenerateResult` with its base64 routed experts as narrowed ids (`predecode`)."""
    if isinstance(result, GenerateResult) and isinstance(result.routed_experts, bytes):
        return dataclasses.replace(result, routed_experts=predecode(result.routed_experts))
    return result


class ReplyDecoder:
    """An `Offload` for engine adapters: `await decoder.run(parse_fn, body, **kw)`."""

    def __init__(self, threads: CpuOffload, *, processes: int = 1, large_reply_bytes: int = LARGE_REPLY_BYTES,
                 malloc_retain_mb: int = 0) -> None:
        """Replies of at least `large_reply_bytes` go to `processes` worker processes;
        the rest to the offload threads (inline when small). `malloc_retain_mb`: the
        workers' `retain_large_blocks` (0: the allocator left as it is), checked here:
        a worker whose initializer raised would break the pool."""
        if not 0 <= malloc_retain_mb <= MAX_RETAIN_MB:
            raise ValueError(f"malloc_retain_mb must be within 0..{MAX_RETAIN_MB}, not {malloc_retain_mb}")
        self._threads = threads
        self.large_reply_bytes = large_reply_bytes
        self._procs: ProcessPoolExecutor | None = None
        if processes > 0:
            # the forkserver and its workers die with this process, even by `kill -9`
            # (parent_death.py): the forkserver arms itself on importing the module, the
            # workers in the pool's initializer
            os.environ[DIE_WITH_ENV] = str(os.getpid())
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["session_server.parent_death", "session_server.engines"])
            self._procs = ProcessPoolExecutor(max_workers=processes, mp_context=ctx,
                                              initializer=_init_worker, initargs=(os.getpid(), malloc_retain_mb))

    async def start(self) -> None:
        """Start the workers now, not on the first large reply."""
        if self._procs is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._procs, _warm)

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "__self__", None) is not None:
            # a bound method (a stream fold's `add` / `result`, engines/http.py `fold_stream`)
            # keeps its state in this process: a worker process would change only a copy
            return await self._routed_decoded(await self._threads.run(fn, *args, **kwargs))
        body = args[0] if args else None
        size = len(body) if isinstance(body, bytes) else 0
        if self._procs is not None and size >= self.large_reply_bytes:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._procs, functools.partial(_parse, fn, *args, **kwargs))
        return await self._threads.run_sized(size, fn, *args, **kwargs)

    async def _routed_decoded(self, result: Any) -> Any:
        """A streamed result's large routed-experts payload decoded in the worker."""
        raw = result.routed_experts if isinstance(result, GenerateResult) else None
        if self._procs is None or not isinstance(raw, bytes) or len(raw) < self.large_reply_bytes:
            return result
        loop = asyncio.get_running_loop()
        routed = await loop.run_in_executor(self._procs, predecode, raw)
        return dataclasses.replace(result, routed_experts=routed)

    def shutdown(self) -> None:
        if self._procs is not None:
            self._procs.shutdown(wait=True, cancel_futures=True)
