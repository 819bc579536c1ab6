"""Routing turns to (engine, dp_rank) targets: policies, pool, admission, health.

One policy per module behind `policy.RoutingPolicy`; `make_policy(name, **cfg)`
builds one by name. See docs/architecture.md.
"""

from __future__ import annotations

from .admission import AdmissionConfig, PrefillAdmission
from .bounded_load import BoundedLoad, BoundedLoadConfig
from .cache_aware import CacheAware, CacheAwareConfig
from .consistent_hash import ConsistentHash, ConsistentHashConfig
from .factory import POLICY_NAMES, make_policy
from .health import check_health_once, health_check_loop, is_dead_signal, record_failure
from .policy import (
    PolicyBase,
    RoutingPolicy,
    RoutingSignals,
    TargetView,
    prefix_block_hashes,
    rendezvous_score,
)
from .pool import Engine, EnginePool, TargetStats
from .round_robin import RoundRobin, RoundRobinConfig
from .sticky_cost import StickyCost, StickyCostConfig
from .sticky_least_loaded import StickyLeastLoaded, StickyLeastLoadedConfig

__all__ = [
    "POLICY_NAMES",
    "AdmissionConfig",
    "BoundedLoad",
    "BoundedLoadConfig",
    "CacheAware",
    "CacheAwareConfig",
    "ConsistentHash",
    "ConsistentHashConfig",
    "Engine",
    "EnginePool",
    "PolicyBase",
    "PrefillAdmission",
    "RoundRobin",
    "RoundRobinConfig",
    "RoutingPolicy",
    "RoutingSignals",
    "StickyCost",
    "StickyCostConfig",
    "StickyLeastLoaded",
    "StickyLeastLoadedConfig",
    "TargetStats",
    "TargetView",
    "is_dead_signal",
    "make_policy",
    "prefix_block_hashes",
    "health_check_loop",
    "check_health_once",
    "record_failure",
    "rendezvous_score",
]
