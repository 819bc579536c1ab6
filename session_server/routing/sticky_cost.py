"""`sticky_cost` (the default): a sticky home per session, placement by estimated cost.

- every turn goes home while home is healthy (its KV holds the context);
- a new or re-homed session goes to the cheapest healthy target, where
  cost_s = (pending uncached prefill tokens + this prompt) / prefill rate
           + load * in_flight_cost_s
           + kv_barrier_s if resident + this prompt would pass kv_high_water;
  ties by fewest resident sessions, then rendezvous hash. Pending tokens grow as
  re-homed sessions land, so a dead engine's sessions spread over the survivors;
- migration off a healthy home only for small contexts, and only when home has
  >= migrate_min_extra_in_flight more turns in flight than the least loaded and
  >= migrate_load_ratio times as many; a long (or unknown-length) context never
  moves. Homes are never restored: a recovered engine gets only new placements.

Placement's load is `placement_load`: this instance's in-flight turns plus the
requests the engine reported beyond them at the last poll (other instances').
Migration counts only this instance's own turns: every instance sees the same
polled report, up to a poll period old, so migrating on it would move all instances'
sessions off one engine at once, and back at the next poll, re-prefilling each time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import (
    PolicyBase,
    RoutingSignals,
    TargetView,
    healthy_targets,
    home_if_healthy,
    rendezvous_score,
)


@dataclass(frozen=True, slots=True)
class StickyCostConfig:
    prefill_tokens_per_s: float = 8000.0
    in_flight_cost_s: float = 1.0
    kv_high_water: float = 0.9
    kv_barrier_s: float = 3600.0
    migrate_min_extra_in_flight: int = 8
    migrate_load_ratio: float = 2.0
    migrate_max_context_tokens: int = 8192


class StickyCost(PolicyBase):
    name = "sticky_cost"

    def __init__(self, config: StickyCostConfig | None = None) -> None:
        self.config = config or StickyCostConfig()

    def cost_s(self, t: TargetView, prompt_tokens: int) -> float:
        """Estimated seconds before a new prompt of `prompt_tokens` finishes prefill on `t`."""
        cfg = self.config
        cost = (t.pending_prefill_tokens + prompt_tokens) / cfg.prefill_tokens_per_s
        cost += t.placement_load * cfg.in_flight_cost_s  # + other instances' load
        cap = t.kv_capacity_tokens
        if cap is not None and t.resident_tokens + prompt_tokens > cfg.kv_high_water * cap:
            cost += cfg.kv_barrier_s
        return cost

    def _place(self, signals: RoutingSignals, candidates: list[TargetView]) -> str:
        n = signals.context_tokens or 0
        sid = signals.session_id
        return min(
            candidates,
            key=lambda t: (round(self.cost_s(t, n), 9), t.sessions, -rendezvous_score(sid, t.id)),
        ).id

    def select(self, signals: RoutingSignals) -> str | None:
        healthy = healthy_targets(signals)
        if not healthy:
            return None
        home = home_if_healthy(signals)
        if home is None:
            return self._place(signals, healthy)
        cfg = self.config
        ctx = signals.context_tokens
        if ctx is None or ctx >= cfg.migrate_max_context_tokens or len(healthy) < 2:
            return home.id
        least = min(t.in_flight for t in healthy if t.id != home.id)
        if (
            home.in_flight - least >= cfg.migrate_min_extra_in_flight
            and home.in_flight >= cfg.migrate_load_ratio * least
        ):
            return self._place(signals, [t for t in healthy if t.id != home.id])
        return home.id
