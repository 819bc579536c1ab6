"""The control plane's engine-side bookkeeping: segments in flight and background aborts.

`Flights` knows which request ids are at which engine (and LoRA adapter), so a per-LoRA
abort finds them by id and a `wait` pause can drain them. `EngineAborts` sends an abort
for a request nobody waits for any more (a cancelled or timed-out turn, a turn cut at a
weight update) without blocking its caller, and lets `resume` wait until they landed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .metrics import ControlMetrics

__all__ = ["EngineAborts", "Flights"]

log = logging.getLogger(__name__)


@dataclass
class _Flight:
    engine: str
    lora: str | None


class Flights:
    """Request ids of segments now at an engine; loop-atomic."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Flight] = {}
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._by_id)

    @contextmanager
    def track(self, rid: str, *, engine: str, lora: str | None) -> Iterator[None]:
        self._by_id[rid] = _Flight(engine, lora)
        try:
            yield
        finally:
            if self._by_id.pop(rid, None) is not None:
                self._changed.set()
                self._changed = asyncio.Event()

    def ids(self, *, engine: str | None = None, lora: str | None = None) -> list[str]:
        return [
            rid for rid, f in self._by_id.items()
            if (engine is None or f.engine == engine) and (lora is None or f.lora == lora)
        ]

    async def drain(self, timeout_s: float, *, engine: str | None = None, lora: str | None = None) -> bool:
        """Wait until no matching segment is in flight; False when `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while self.ids(engine=engine, lora=lora):
            changed = self._changed
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                continue
        return True


class EngineAborts:
    """Aborts sent in the background, each bounded by `timeout_s`, counted by outcome."""

    def __init__(self, metrics: ControlMetrics, timeout_s: float) -> None:
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, adapter: Any, rid: str) -> None:
        fn = adapter.abort_request  # every adapter can (engines/base.py `EngineAdapter`)

        async def run() -> None:
            try:
                await asyncio.wait_for(fn(rid), self.timeout_s)
                self.metrics.engine_aborts_total.labels("sent").inc()
            except Exception as exc:
                self.metrics.engine_aborts_total.labels("failed").inc()
                log.warning("abort of %s on %s failed: %r", rid, adapter.base_url, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
