"""`round_robin`: every turn to the next healthy target, ignoring homes.

The engines' own default DP dispatch (SGLang); a baseline that reproduces the
re-prefill storm, since a session's next turn almost never lands where its KV is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import PolicyBase, RoutingSignals, healthy_targets


@dataclass(frozen=True, slots=True)
class RoundRobinConfig:
    start: int = 0


class RoundRobin(PolicyBase):
    name = "round_robin"

    def __init__(self, config: RoundRobinConfig | None = None) -> None:
        self.config = config or RoundRobinConfig()
        self._next = self.config.start

    def select(self, signals: RoutingSignals) -> str | None:
        healthy = healthy_targets(signals)
        if not healthy:
            return None
        choice = healthy[self._next % len(healthy)]
        self._next += 1
        return choice.id
