"""A live stack for server tests: simulated engine(s) + the server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.ops.harness import running_server
from session_server.sim import running_sim

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Fix the failing test."}], "max_tokens": 64}


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0.0 when absent): tests assert values move."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


@dataclass
class Stack:
    url: str
    engines: list[str]
    http: httpx.AsyncClient
    app_state: Any = None

    async def session(self, **body: Any) -> str:
        r = await self.http.post("/sessions", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["session_id"])

    async def chat(self, sid: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
        return await self.http.post(f"/sessions/{sid}/v1/chat/completions", json=body or CHAT, **kw)

    async def trajectory(self, sid: str) -> dict[str, Any]:
        r = await self.http.get(f"/sessions/{sid}/trajectory")
        assert r.status_code == 200, r.text
        return r.json()

    async def engine_log(self, i: int = 0) -> list[dict[str, Any]]:
        async with httpx.AsyncClient() as c:
            return (await c.get(f"{self.engines[i]}/sim/requests")).json()

    async def aborted_rids(self, i: int = 0) -> list[str]:
        """Request ids the engine was asked to abort (the simulator's abort log)."""
        return await sim_aborted_rids(self.engines[i])

    async def raw_chat(self, sid: str, body: dict[str, Any]) -> asyncio.StreamWriter:
        """Send a chat over a raw socket; closing the writer is a real client disconnect."""
        host, port = self.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        data = orjson.dumps(body)
        writer.write(
            f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
        )
        await writer.drain()
        return writer

    async def script(self, sid: str, *turns: dict[str, Any], i: int = 0) -> None:
        """Script session `sid`'s answers on engine `i` (`POST /sim/script`, kept for that
        session): a test that needs a long answer, or given tool calls, says so here rather
        than leaning on whatever the simulator answers unscripted."""
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{self.engines[i]}/sim/script", json={"turns": list(turns), "session": sid})
            assert r.status_code == 200 and r.json()["scope"] == "session", r.text

    async def fault(self, kind: str, count: int = 1, i: int = 0) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{self.engines[i]}/sim/faults", json={"kind": kind, "count": count})
            assert r.status_code == 200, r.text


async def until_in_flight(st: Stack, sid: str) -> None:
    """Wait until session `sid` has a chat in flight (its view says busy)."""
    for _ in range(400):
        if (await st.http.get(f"/sessions/{sid}")).json()["busy"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never in flight")


async def sim_aborted_rids(engine: str) -> list[str]:
    """Every request id in the simulator's abort log (SGLang `rid`, vLLM `request_ids`), as
    the server named it: vLLM is asked by each of its own forms of one id (`cmpl-ID`,
    `generate-tokens-ID` and the bare ID), counted once per call."""
    async with httpx.AsyncClient() as c:
        log = (await c.get(f"{engine}/sim/aborts")).json()
    out: list[str] = []
    for call in log["calls"]:
        body = call["body"]
        if "rid" in body:
            out.append(body["rid"])
            continue
        ids = [r.removeprefix("generate-tokens-").removeprefix("cmpl-") for r in body.get("request_ids", [])]
        out += list(dict.fromkeys(ids))
    return out


@contextlib.asynccontextmanager
async def live_stack(
    tokenizer_dir: Path,
    protocol: str = "sglang",
    *,
    n_engines: int = 1,
    dp: int = 1,
    latency_ms: float = 0.0,
    noncanonical: bool = False,
    settings: Settings | None = None,
    extra_engines: Sequence[str] = (),
    span_exporter: Any = None,
    **sim_kwargs: Any,
) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [
            await stack.enter_async_context(
                running_sim(protocol, str(tokenizer_dir), seed=3 + i, dp=dp, latency_ms=latency_ms, noncanonical=noncanonical,
                            **sim_kwargs)
            )
            for i in range(n_engines)
        ]
        config = AppConfig(
            tokenizer=str(tokenizer_dir),
            engines=[f"{protocol}={u}" for u in urls] + list(extra_engines),
            settings=settings or Settings(),
            span_exporter=span_exporter,
        )
        url = await stack.enter_async_context(running_server(config))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
        yield Stack(url, urls, http)
