"""The server keeps idle keep-alive connections longer than client pools
do, so a pooled connection a busy client reuses late is still open (no disconnect)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import uvicorn

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.ops import cli, harness
from session_server.ops.harness import free_port, running_server
from session_server.ops.serving import KEEP_ALIVE_S, LISTEN_BACKLOG, uvicorn_options


def _opts(**kw: Any) -> dict[str, Any]:
    return uvicorn_options(host="127.0.0.1", port=1, log_level="warning", timeout_graceful_shutdown=5, **kw)


async def test_keep_alive_outlasts_client_pools_and_backlog_takes_10k_agents() -> None:
    opts = _opts()
    assert opts["timeout_keep_alive"] == KEEP_ALIVE_S == 75
    assert opts["backlog"] == LISTEN_BACKLOG == 4096
    assert opts["lifespan"] == "on" and opts["http"] == "httptools" and opts["loop"] == "uvloop"
    # clients close their idle connections first: no reuse of one the server is closing
    async with aiohttp.TCPConnector() as connector:
        assert connector._keepalive_timeout < KEEP_ALIVE_S  # 15 s
    assert (httpx.Limits().keepalive_expiry or 0) < KEEP_ALIVE_S  # 5 s
    uvicorn.Config(app=None, **opts)  # every key is one uvicorn accepts


def test_serve_runs_uvicorn_with_the_shared_options(monkeypatch: pytest.MonkeyPatch, qwen3_dir: Path) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(cli.sys, "setswitchinterval", lambda _s: None)
    monkeypatch.setattr(cli.gc, "set_threshold", lambda *_a: None)
    import session_server.malloc_tuning as malloc_tuning

    monkeypatch.setattr(malloc_tuning, "retain_large_blocks", lambda _mb: True)  # not this test process's allocator
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", str(qwen3_dir), "--port", "8123"])
    assert rc == 0
    assert seen["timeout_keep_alive"] == KEEP_ALIVE_S and seen["backlog"] == LISTEN_BACKLOG
    assert {k: seen[k] for k in ("host", "port", "loop", "http", "lifespan")} == {
        "host": "127.0.0.1", "port": 8123, "loop": "uvloop", "http": "httptools", "lifespan": "on",
    }


async def _get_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One GET /health on an open connection; returns the status line ('' if closed)."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")  # IncompleteReadError if the server closed
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


async def test_harness_server_keeps_an_idle_connection_past_uvicorns_5s_default(
    monkeypatch: pytest.MonkeyPatch, qwen3_dir: Path
) -> None:
    configs: list[dict[str, Any]] = []

    class RecordingConfig(uvicorn.Config):
        def __init__(self, app: Any, **kw: Any) -> None:
            configs.append(kw)
            super().__init__(app, **kw)

    monkeypatch.setattr(harness.uvicorn, "Config", RecordingConfig)
    dead = f"sglang=http://127.0.0.1:{free_port()}"  # /health answers without an engine
    config = AppConfig(tokenizer=str(qwen3_dir), engines=[dead], settings=Settings())
    async with running_server(config) as url:
        assert configs == [_opts(loop="none") | {"port": configs[0]["port"]}]
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            first = await _get_health(reader, writer)
            await asyncio.sleep(6.0)  # idle past uvicorn's default keep-alive (5 s)
            assert await _get_health(reader, writer) == first  # same connection, still served
        finally:
            writer.close()


def test_health_checks_answered_200_are_not_in_the_access_log() -> None:
    """A cluster's HAProxy checks every worker every second: a line each buried the log.
    A failing check (503 while recovering or syncing) stays."""
    import logging.config

    config = uvicorn_options(host="127.0.0.1", port=1, log_level="info", timeout_graceful_shutdown=1)["log_config"]
    logging.config.dictConfig(config)  # what uvicorn does with it
    access = logging.getLogger("uvicorn.access")
    fmt = '%s - "%s %s HTTP/%s" %d'

    def shown(path: str, status: int) -> bool:
        record = access.makeRecord("uvicorn.access", logging.INFO, __file__, 0, fmt,
                                   ("127.0.0.1:1", "GET", path, "1.0", status), None)
        return all(h.filter(record) for h in access.handlers)

    assert access.handlers
    assert not shown("/health", 200)
    assert shown("/health", 503) and shown("/sessions/x/trajectory", 200)
