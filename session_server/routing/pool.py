"""The engine pool: engines, their DP-rank targets, per-target load, and homes.

A target is (engine, dp_rank). Every turn of a session goes to its home target
(prefix affinity: the KV cache of a long context lives there). A new session, or
one whose home died, is placed on the least-loaded healthy target (in-flight
turns, then resident sessions), ties broken by rendezvous hashing on the session
id so placement is stable and spread. The policy is a pure object (see
`policy.py`); this module owns the mutable bookkeeping it reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..engines.base import EngineAdapter
from ..errors import NoHealthyEngine
from .policy import RoutingPolicy, StickyLeastLoaded, TargetView


@dataclass
class Engine:
    id: str
    adapter: EngineAdapter
    dp_size: int = 1
    healthy: bool = True
    last_failure_s: float | None = None


@dataclass
class TargetStats:
    engine_id: str
    dp_rank: int
    in_flight: int = 0
    sessions: set[str] = field(default_factory=set)
    resident_tokens: int = 0

    @property
    def id(self) -> str:
        return f"{self.engine_id}/{self.dp_rank}"


class EnginePool:
    """Engines and targets of this server process; loop-atomic, no awaits inside."""

    def __init__(
        self, policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engines: dict[str, Engine] = {}
        self.targets: dict[str, TargetStats] = {}
        self.policy = policy or StickyLeastLoaded()
        self._clock = clock

    def add(self, engine_id: str, adapter: EngineAdapter, dp_size: int = 1) -> Engine:
        eng = Engine(engine_id, adapter, max(1, dp_size))
        self.engines[engine_id] = eng
        for rank in range(eng.dp_size):
            t = TargetStats(engine_id, rank)
            self.targets[t.id] = t
        return eng

    def remove(self, engine_id: str) -> Engine | None:
        eng = self.engines.pop(engine_id, None)
        for tid in [tid for tid, t in self.targets.items() if t.engine_id == engine_id]:
            del self.targets[tid]
        return eng

    def adapters(self) -> Iterable[EngineAdapter]:
        return (e.adapter for e in self.engines.values())

    def _views(self) -> list[TargetView]:
        return [
            TargetView(
                id=t.id,
                healthy=self.engines[t.engine_id].healthy,
                in_flight=t.in_flight,
                sessions=len(t.sessions),
                resident_tokens=t.resident_tokens,
            )
            for t in self.targets.values()
        ]

    def select(self, session_id: str, home: str | None) -> TargetStats:
        """The target for this turn: home if healthy, else a placement."""
        choice = self.policy.select(session_id, home, self._views(), self._clock())
        if choice is None:
            raise NoHealthyEngine("no healthy engine target")
        target = self.targets[choice]
        if home != choice:
            if home is not None and home in self.targets:
                self.targets[home].sessions.discard(session_id)
            target.sessions.add(session_id)
        return target

    def forget(self, session_id: str, home: str | None) -> None:
        if home is not None and home in self.targets:
            self.targets[home].sessions.discard(session_id)

    def engine_of(self, target: TargetStats) -> Engine:
        return self.engines[target.engine_id]

    def mark_failed(self, engine_id: str) -> None:
        """Passive health: a connection-level failure marks the engine unhealthy."""
        eng = self.engines.get(engine_id)
        if eng is not None:
            eng.healthy = False
            eng.last_failure_s = self._clock()

    def mark_healthy(self, engine_id: str) -> None:
        eng = self.engines.get(engine_id)
        if eng is not None:
            eng.healthy = True
