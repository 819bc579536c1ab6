"""`sticky_least_loaded`: stay home while home is healthy; place on the fewest active.

Placement key: (load, resident sessions, rendezvous hash), where load is our
in-flight turns plus the engine-reported rest (`placement_load`). Never
migrates a live home; blind to prefill cost and KV pressure (see `sticky_cost`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import PolicyBase, RoutingSignals, healthy_targets, home_if_healthy, rendezvous_score


@dataclass(frozen=True, slots=True)
class StickyLeastLoadedConfig:
    pass


class StickyLeastLoaded(PolicyBase):
    name = "sticky_least_loaded"

    def __init__(self, config: StickyLeastLoadedConfig | None = None) -> None:
        self.config = config or StickyLeastLoadedConfig()

    def select(self, signals: RoutingSignals) -> str | None:
        healthy = healthy_targets(signals)
        if not healthy:
            return None
        if home_if_healthy(signals) is not None:
            return signals.home
        sid = signals.session_id
        best = min(healthy, key=lambda t: (t.placement_load, t.sessions, -rendezvous_score(sid, t.id)))
        return best.id
