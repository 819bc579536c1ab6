"""The event loop's lag is a metric: an operator sees a blocked loop without a bench.

`tito_event_loop_lag_seconds` observes how late a timer fired every
`loop_lag_probe_s`. The in-process server shares this test's loop, so blocking it here
for 0.3 s is what a CPU-bound callback in the server would do."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.ops.harness import running_server
from session_server.sim import running_sim


def _lag(metrics: str) -> tuple[float, float, float]:
    """(count, sum, count of observations over 0.25 s)."""
    count = float(re.search(r"^tito_event_loop_lag_seconds_count (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    total = float(re.search(r"^tito_event_loop_lag_seconds_sum (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    upto = float(re.search(r'^tito_event_loop_lag_seconds_bucket\{le="0.25"\} (\S+)$', metrics, re.M).group(1))  # type: ignore[union-attr]
    return count, total, count - upto


async def test_a_blocked_loop_shows_in_the_lag_histogram(qwen3_dir: Path) -> None:
    async with running_sim("sglang", str(qwen3_dir), seed=1) as engine, \
            running_server(AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={engine}"],
                                     settings=Settings(loop_lag_probe_s=0.02))) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        await asyncio.sleep(0.2)
        count0, _, over0 = _lag((await http.get("/metrics")).text)
        assert count0 >= 1
        time.sleep(0.35)  # the loop is blocked: the probe's timer fires about 0.35 s late
        await asyncio.sleep(0.1)
        count1, total1, over1 = _lag((await http.get("/metrics")).text)
        assert count1 > count0 and over1 >= over0 + 1 and total1 >= 0.3


async def test_the_probe_can_be_turned_off(qwen3_dir: Path) -> None:
    async with running_sim("sglang", str(qwen3_dir), seed=1) as engine, \
            running_server(AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={engine}"],
                                     settings=Settings(loop_lag_probe_s=0))) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        await asyncio.sleep(0.1)
        assert _lag((await http.get("/metrics")).text)[0] == 0
