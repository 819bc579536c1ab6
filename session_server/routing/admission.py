"""Prefill admission: at most N large uncached prefills in flight per engine.

A large prefill stalls every DP rank of its engine (ranks step in lock-step), so
the server queues the rest itself, FIFO per engine, *before* the engine request
and its deadline start. Small prefills (the usual sticky turn) never wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_large_per_engine: int = 1
    large_prefill_tokens: int = 16384


class PrefillAdmission:
    """Per-engine FIFO semaphores for large prefills; loop-local, create inside the loop."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}
        self._active: dict[str, int] = {}

    def is_large(self, uncached_tokens: int) -> bool:
        return uncached_tokens >= self.config.large_prefill_tokens

    def waiting(self, engine_id: str) -> int:
        return self._waiting.get(engine_id, 0)

    def active(self, engine_id: str) -> int:
        return self._active.get(engine_id, 0)

    @asynccontextmanager
    async def acquire(self, engine_id: str, uncached_tokens: int) -> AsyncIterator[None]:
        """Hold an admission slot for the body (the engine call) if the prefill is large."""
        if not self.is_large(uncached_tokens):
            yield
            return
        sem = self._sems.get(engine_id)
        if sem is None:
            sem = self._sems[engine_id] = asyncio.Semaphore(self.config.max_large_per_engine)
        self._waiting[engine_id] = self._waiting.get(engine_id, 0) + 1
        try:
            await sem.acquire()
        finally:
            self._waiting[engine_id] -= 1
        self._active[engine_id] = self._active.get(engine_id, 0) + 1
        try:
            yield
        finally:
            self._active[engine_id] -= 1
            sem.release()
