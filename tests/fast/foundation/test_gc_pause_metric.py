"""The cyclic GC's passes are a metric: an operator sees what a full pass over the live
sessions costs without a bench (`tito_gc_pause_seconds`, by generation)."""

from __future__ import annotations

import gc
import re
import time
from pathlib import Path

import httpx

from session_server.app import AppConfig
from session_server.context import Settings
from session_server.metrics import Metrics
from session_server.ops.harness import live_apps, running_server
from session_server.sim import running_sim


def _passes(metrics: str, generation: int) -> tuple[float, float, float]:
    """(count, sum, count of passes over 10 ms) of one generation."""
    def one(suffix: str, more: str = "") -> float:
        pattern = rf'^tito_gc_pause_seconds_{suffix}\{{generation="{generation}"{more}\}} (\S+)$'
        return float(re.search(pattern, metrics, re.M).group(1))  # type: ignore[union-attr]

    count = one("count")
    return count, one("sum"), count - one("bucket", ',le="0.01"')


async def test_a_full_pass_is_counted_and_timed_while_the_server_runs(qwen3_dir: Path) -> None:
    async with running_sim("sglang", str(qwen3_dir), seed=1) as engine, \
            running_server(AppConfig(tokenizer=str(qwen3_dir), engines=[f"sglang={engine}"],
                                     settings=Settings())) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        hook = live_apps[url].state.ctx.metrics.gc_pauses._on_gc
        count0, total0, slow0 = _passes((await http.get("/metrics")).text, 2)
        keep = [[i] for i in range(300_000)]  # a full pass has these to scan (making them may start some)
        started = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - started
        count1, total1, slow1 = _passes((await http.get("/metrics")).text, 2)
        del keep
        assert count1 >= count0 + 1 and total1 - total0 >= 0.5 * took  # the same pass, timed inside and out
        assert 0 <= slow1 - slow0 <= count1 - count0
        assert hook in gc.callbacks
    assert hook not in gc.callbacks  # stopped: the process's other apps' GC is not timed into it


def test_a_pass_whose_start_was_not_seen_is_not_counted() -> None:
    """Installed while a pass ran (from another thread, or a finalizer), the hook sees its
    end alone: that pass is skipped, not timed from zero."""
    metrics = Metrics()
    metrics.gc_pauses._on_gc("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    metrics.gc_pauses._on_gc("start", {"generation": 0})
    metrics.gc_pauses._on_gc("stop", {"generation": 0, "collected": 0, "uncollectable": 0})
    text = metrics.render().decode()
    assert _passes(text, 2)[:2] == (0, 0) and _passes(text, 0)[0] == 1
    assert _passes(text, 0)[1] < 1.0
