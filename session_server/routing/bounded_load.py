"""`bounded_load`: consistent hashing with bounded loads (Mirrokni et al., c = 1.25).

Walks the same ring as `consistent_hash` but skips a target whose load would
exceed ceil(c * (total + 1) / healthy targets): affinity until a target is hot,
then the overflow spills clockwise (and loses its cache). Load is the target's
`placement_load`: our in-flight turns plus what the engine reports beyond them
(other instances' work, as of the last poll), so the bound counts what
every instance put on a target, not only this one's turns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .consistent_hash import HashRing
from .policy import PolicyBase, RoutingSignals, healthy_targets


@dataclass(frozen=True, slots=True)
class BoundedLoadConfig:
    c: float = 1.25
    vnodes: int = 150


class BoundedLoad(PolicyBase):
    name = "bounded_load"

    def __init__(self, config: BoundedLoadConfig | None = None) -> None:
        self.config = config or BoundedLoadConfig()
        self._ring = HashRing(self.config.vnodes)

    def select(self, signals: RoutingSignals) -> str | None:
        healthy = healthy_targets(signals)
        if not healthy:
            return None
        total = sum(t.placement_load for t in healthy)
        cap = math.ceil(self.config.c * (total + 1) / len(healthy))
        for t in self._ring.walk(signals.session_id, signals.targets):
            if t.healthy and t.placement_load + 1 <= cap:
                return t.id
        return None
