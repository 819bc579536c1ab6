"""uvicorn options for every way this server is served (`serve`, the test harness).

One place, so the settings a benchmark or a test measures are the ones
production runs with.

Keep-alive. uvicorn closes a keep-alive connection idle for `timeout_keep_alive`
seconds, 5 by default. A client pool that took such a connection just before
(acquired it, has not yet written on it) loses the race: its request meets the
server's close and the client sees a clean disconnect (aiohttp:
`ServerDisconnectedError`), not an answer. Measured with 10,000 agents on a busy
2-core host (bench/README.md, "Disconnects under load"): an aiohttp pool's
request went out 5.4-11.5 s after its connection's last response, and every one of
the 512 pooled connections was lost that way. The server must therefore keep an
idle connection longer than clients keep theirs: aiohttp's pool closes idle
connections after 15 s (`TCPConnector(keepalive_timeout=15)`), httpx's after 5 s
(`Limits(keepalive_expiry=5.0)`), so clients close first and never reuse a
connection the server is closing. 75 s is nginx's default (`keepalive_timeout`).
Cost: an idle connection's socket is kept up to 75 s (one file descriptor; the
`serve` start-up raises RLIMIT_NOFILE).

Backlog. 10,000 agents connecting at once overflow uvicorn's default accept
queue of 2,048 (the kernel caps it at net.core.somaxconn).
"""

from __future__ import annotations

import logging
from typing import Any

KEEP_ALIVE_S = 75
"""Seconds an idle keep-alive connection stays open; longer than client pools keep theirs."""

LISTEN_BACKLOG = 4096
"""Accept-queue length asked of the kernel (capped there by net.core.somaxconn)."""


class QuietHealthChecks(logging.Filter):
    """Drops uvicorn's access line for a `GET /health` answered 200. A proxy checks every
    worker every second (`session-server cluster`'s HAProxy, a Kubernetes probe): those
    lines would bury everything else; a failing check (503 recovering, syncing) is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn: (client, method, path, http version, status)
        return not (isinstance(args, tuple) and len(args) == 5 and args[2] == "/health" and args[4] == 200)


def access_log_config() -> dict[str, Any]:
    """uvicorn's own logging config, its access handler filtered by `QuietHealthChecks`."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["quiet_health_checks"] = {"()": QuietHealthChecks}
    config["handlers"]["access"]["filters"] = ["quiet_health_checks"]
    return config


def uvicorn_options(
    *, host: str, port: int, log_level: str, timeout_graceful_shutdown: int, loop: str = "uvloop"
) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.run` / `uvicorn.Config`, shared by `serve`
    and the harness; `loop="none"` serves on an already running loop."""
    return {
        "host": host,
        "port": port,
        "loop": loop,
        "http": "httptools",
        "log_level": log_level,
        "lifespan": "on",
        "timeout_keep_alive": KEEP_ALIVE_S,
        "timeout_graceful_shutdown": timeout_graceful_shutdown,
        "backlog": LISTEN_BACKLOG,
        "log_config": access_log_config(),
    }
