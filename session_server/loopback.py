"""Serving a small aiohttp app on 127.0.0.1 (the simulated engines, the verifier's
recording proxy): one place that binds loopback only, on a free port, and cleans up."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web


@contextlib.asynccontextmanager
async def serving_aiohttp(app: web.Application, **runner_options: Any) -> AsyncIterator[str]:
    """Serve an aiohttp app on a free 127.0.0.1 port for the duration; yields its base URL."""
    runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None, **runner_options)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
