"""`make_policy(name, **cfg)`: the one place a policy name becomes an object.

Names equal module names and config tags; the defaults live in each policy's
config dataclass, so `cfg` only carries overrides.
"""

from __future__ import annotations

from typing import Any

from .bounded_load import BoundedLoad, BoundedLoadConfig
from .cache_aware import CacheAware, CacheAwareConfig
from .consistent_hash import ConsistentHash, ConsistentHashConfig
from .policy import RoutingPolicy
from .round_robin import RoundRobin, RoundRobinConfig
from .sticky_cost import StickyCost, StickyCostConfig
from .sticky_least_loaded import StickyLeastLoaded, StickyLeastLoadedConfig

POLICY_NAMES: tuple[str, ...] = (
    "sticky_cost",
    "round_robin",
    "consistent_hash",
    "bounded_load",
    "cache_aware",
    "sticky_least_loaded",
)


def make_policy(name: str, **cfg: Any) -> RoutingPolicy:
    """A fresh policy object; unknown names and unknown config keys raise."""
    match name:
        case "sticky_cost":
            return StickyCost(StickyCostConfig(**cfg))
        case "round_robin":
            return RoundRobin(RoundRobinConfig(**cfg))
        case "consistent_hash":
            return ConsistentHash(ConsistentHashConfig(**cfg))
        case "bounded_load":
            return BoundedLoad(BoundedLoadConfig(**cfg))
        case "cache_aware":
            return CacheAware(CacheAwareConfig(**cfg))
        case "sticky_least_loaded":
            return StickyLeastLoaded(StickyLeastLoadedConfig(**cfg))
        case _:
            raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
