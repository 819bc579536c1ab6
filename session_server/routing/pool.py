"""The engine pool: engines, their DP-rank targets, per-target load, and homes.

Pure bookkeeping: an engine here is an id, a DP size, health and counters; its
adapter lives in `engines/registry.py`, so routing policies and the simulator share
this module without importing any engine. A target is (engine, dp_rank). The pool owns the mutable per-target bookkeeping
a policy reads (in-flight turns, pending uncached prefill tokens, resident
sessions and tokens) and the estimate of what each session has cached on its
home; the policy (default `sticky_cost`, see `policy.py`) is a pure object that
decides. Turn protocol: `select(...)` -> caller bumps `target.in_flight` ->
engine call -> `on_turn_complete(...)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import NoHealthyEngine
from .policy import RoutingPolicy, RoutingSignals, TargetView
from .sticky_cost import StickyCost


@dataclass
class Engine:
    id: str
    dp_size: int = 1
    healthy: bool = True
    consecutive_errors: int = 0  # engine-side 5xx in a row; a success resets it
    failed_health_checks: int = 0  # failed active health checks in a row; a healthy one resets it
    reported_load: Any = None  # what the engine says about its own load (SGLang /get_load)


@dataclass
class TargetStats:
    engine_id: str
    dp_rank: int
    in_flight: int = 0
    sessions: set[str] = field(default_factory=set)
    resident_tokens: int = 0
    pending_prefill_tokens: int = 0
    kv_capacity_tokens: int | None = None
    external_load: int = 0  # engine-reported requests beyond ours at the last poll

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
        self.policy: RoutingPolicy = policy or StickyCost()
        self.migrations = 0
        self.rehomes = 0
        self._clock = clock
        self._cached: dict[str, tuple[str, int]] = {}  # session -> (target, tokens cached there)
        self._pending: dict[str, tuple[str, int]] = {}  # session -> (target, uncached tokens)
        self._engines_added = 0

    def add(
        self,
        engine_id: str,
        dp_size: int = 1,
        kv_capacity_tokens: int | None = None,
    ) -> Engine:
        eng = Engine(engine_id, max(1, dp_size))
        self.engines[engine_id] = eng
        for rank in range(eng.dp_size):
            t = TargetStats(engine_id, rank, kv_capacity_tokens=kv_capacity_tokens)
            self.targets[t.id] = t
            self.policy.on_target_added(t.id)
        return eng

    def next_engine_number(self) -> int:
        """Engine ids are never reused, so a removed engine's stale stats can't alias a new one."""
        self._engines_added += 1
        return self._engines_added - 1

    def remove(self, engine_id: str) -> Engine | None:
        eng = self.engines.pop(engine_id, None)
        for tid in [tid for tid, t in self.targets.items() if t.engine_id == engine_id]:
            del self.targets[tid]
            self.policy.on_target_removed(tid)
        for sid in [sid for sid, (tid, _) in self._cached.items() if tid not in self.targets]:
            del self._cached[sid]
        return eng

    def views(self) -> list[TargetView]:
        return [
            TargetView(
                id=t.id,
                healthy=self.engines[t.engine_id].healthy,
                in_flight=t.in_flight,
                sessions=len(t.sessions),
                resident_tokens=t.resident_tokens,
                pending_prefill_tokens=t.pending_prefill_tokens,
                kv_capacity_tokens=t.kv_capacity_tokens,
                engine_id=t.engine_id,
                external_load=t.external_load,
            )
            for t in self.targets.values()
        ]

    def uncached_tokens(self, session_id: str, target_id: str, context_tokens: int) -> int:
        """Estimated prompt tokens `target_id` must prefill (its last full context is cached)."""
        tid, cached = self._cached.get(session_id, (None, 0))
        return context_tokens - min(cached, context_tokens) if tid == target_id else context_tokens

    def select(
        self,
        session_id: str,
        home: str | None,
        *,
        context_tokens: int | None = None,
        prefix_hashes: tuple[int, ...] | None = None,
    ) -> TargetStats:
        """The target for this turn: home if healthy, else a placement (policy's choice).

        With `context_tokens` the turn's uncached tokens count as pending prefill on
        the target until `on_turn_complete`; a repeated select for the same session
        (a retry) releases the previous pending estimate first.
        """
        self._release_pending(session_id)
        signals = RoutingSignals(
            session_id=session_id,
            home=home,
            targets=self.views(),
            now_s=self._clock(),
            context_tokens=context_tokens,
            prefix_hashes=prefix_hashes,
        )
        choice = self.policy.select(signals)
        if choice is None:
            raise NoHealthyEngine("no healthy engine target")
        target = self.targets[choice]
        if home != choice:
            old = self.targets.get(home) if home is not None else None
            if old is not None:
                old.sessions.discard(session_id)
                if self.engines[old.engine_id].healthy:
                    self.migrations += 1
                else:
                    self.rehomes += 1
            target.sessions.add(session_id)
        if context_tokens is not None:
            uncached = self.uncached_tokens(session_id, choice, context_tokens)
            target.pending_prefill_tokens += uncached
            self._pending[session_id] = (choice, uncached)
        return target

    def _release_pending(self, session_id: str) -> None:
        tid, uncached = self._pending.pop(session_id, (None, 0))
        if tid is not None and tid in self.targets:
            self.targets[tid].pending_prefill_tokens -= uncached

    def on_turn_complete(
        self, target: TargetStats, session_id: str, *, ok: bool, total_tokens: int | None = None
    ) -> None:
        """A turn left the engine: release its pending prefill; on success record the
        session's cached context (prompt + output = `total_tokens`) on `target`."""
        self._release_pending(session_id)
        eng = self.engines.get(target.engine_id)
        if eng is None or self.targets.get(target.id) is not target:
            return  # removed while the turn ran: its generation is still good, only stats go
        if ok:
            eng.consecutive_errors = 0
        if ok and total_tokens is not None:
            self._set_cached(session_id, target.id, total_tokens)
        self.policy.on_turn_complete(session_id, target.id, self._clock())

    def _set_cached(self, session_id: str, target_id: str, tokens: int) -> None:
        old_tid, old_tokens = self._cached.get(session_id, (None, 0))
        if old_tid is not None and old_tid in self.targets:
            self.targets[old_tid].resident_tokens -= old_tokens
        self._cached[session_id] = (target_id, tokens)
        self.targets[target_id].resident_tokens += tokens

    def forget(self, session_id: str, home: str | None) -> None:
        if home is not None and home in self.targets:
            self.targets[home].sessions.discard(session_id)
        self._release_pending(session_id)
        tid, tokens = self._cached.pop(session_id, (None, 0))
        if tid is not None and tid in self.targets:
            self.targets[tid].resident_tokens -= tokens

    def engine_of(self, target: TargetStats) -> Engine:
        eng = self.engines.get(target.engine_id)
        if eng is None:
            raise NoHealthyEngine(f"engine {target.engine_id} was removed")
        return eng

    def set_engine_load(self, engine_id: str, by_rank: dict[int, int] | None) -> None:
        """What `engine_id` reports running + waiting per DP rank (None: unknown). The
        part beyond our own in-flight turns is other instances' work; new placements add
        it to our count (`TargetView.placement_load`), so instances sharing engines
        spread without talking to each other. An engine we know as one
        target (vLLM does not report its DP size) counts every rank it reports: its
        own balancer spreads our requests over them."""
        eng = self.engines.get(engine_id)
        whole = eng is not None and eng.dp_size == 1
        for t in self.targets.values():
            if t.engine_id == engine_id:
                ranks = by_rank or {}
                reported = sum(ranks.values()) if whole else ranks.get(t.dp_rank, 0)
                t.external_load = max(0, reported - t.in_flight)

    def reset_cached(self) -> None:
        """Forget every cached-prefix estimate: after a weight update the cache salt
        changed, so no engine can reuse a prefix computed under the old weights."""
        for tid, tokens in self._cached.values():
            t = self.targets.get(tid)
            if t is not None:
                t.resident_tokens -= tokens
        self._cached.clear()

    def mark_failed(self, engine_id: str) -> None:
        """An unreachable engine: skip it in placement and drop what we believed it cached."""
        eng = self.engines.get(engine_id)
        if eng is not None:
            eng.healthy = False
            for sid in [
                s for s, (tid, _) in self._cached.items() if tid.startswith(f"{engine_id}/")
            ]:
                tid, tokens = self._cached.pop(sid)
                self.targets[tid].resident_tokens -= tokens

    def mark_healthy(self, engine_id: str) -> None:
        """Recovery: eligible for new placements; no session moves back."""
        eng = self.engines.get(engine_id)
        if eng is not None:
            eng.healthy = True
