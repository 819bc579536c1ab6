"""Run the server in-process on a free 127.0.0.1 port (tests, benchmarks, demo).

One implementation for everybody that needs a live server: it binds loopback
only, waits until the server answers, and always shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from ..app import AppConfig, create_app
from ..durability import FATAL
from .serving import uvicorn_options

live_apps: dict[str, FastAPI] = {}
"""Apps served by `running_server`, by base URL: tests reach `app.state` through it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def running_server(
    config: AppConfig, *, log_level: str = "warning", port: int | None = None
) -> AsyncIterator[str]:
    """Serve `create_app(config)` until the block exits; yields the base URL once its
    journal (if any) has replayed. `port`: a port chosen beforehand (a cluster's
    instances name each other as peers before start)."""
    app: FastAPI = create_app(config)
    port = port or free_port()
    # the options `serve` runs with, on the caller's loop
    options = uvicorn_options(host="127.0.0.1", port=port, log_level=log_level, timeout_graceful_shutdown=5, loop="none")
    uv_config = uvicorn.Config(app, **options)
    server = uvicorn.Server(uv_config)
    # _serve, not serve: the embedding process keeps its own signal handlers
    task = asyncio.create_task(server._serve(), name=f"tito-server-{port}")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise a start-up failure
                raise RuntimeError("server exited during start-up")
            await asyncio.sleep(0.01)
        while getattr(app.state, "ctx", None) is not None and app.state.ctx.store.recovering:
            if task.done() or FATAL:  # a journal that does not replay: the store stays closed
                raise RuntimeError(f"the journal did not replay: {FATAL[-1] if FATAL else 'server exited'}")
            await asyncio.sleep(0.01)  # the journal replays: sessions are not back yet
        url = f"http://127.0.0.1:{port}"
        live_apps[url] = app
        yield url
    finally:
        live_apps.pop(f"http://127.0.0.1:{port}", None)
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=15)
