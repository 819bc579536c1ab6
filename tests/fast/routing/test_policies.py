"""Contract tests parametrised over every routing policy, through the real `EnginePool`.

Exact selection sequences (pinned) with a fake clock; an unhealthy engine is
skipped; a removed engine is never chosen and a re-added one is usable.
"""

from __future__ import annotations

import pytest

import session_server.routing as routing
from session_server.errors import NoHealthyEngine
from session_server.routing import POLICY_NAMES, EnginePool, RoutingSignals, TargetView, make_policy
from session_server.routing.policy import prefix_block_hashes


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _pool(name: str) -> EnginePool:
    pool = EnginePool(make_policy(name), clock=FakeClock())
    pool.add("e0", dp_size=2)
    pool.add("e1", dp_size=2)
    return pool


def _hashes(i: int, tokens: int) -> tuple[int, ...]:
    return prefix_block_hashes([i] * tokens)


def _turn(pool: EnginePool, sid: str, homes: dict[str, str], i: int, tokens: int) -> str:
    t = pool.select(sid, homes.get(sid), context_tokens=tokens, prefix_hashes=_hashes(i, tokens))
    t.in_flight += 1
    homes[sid] = t.id
    return t.id


def _run_sequence(name: str) -> tuple[list[str], list[str], list[str]]:
    pool = _pool(name)
    homes: dict[str, str] = {}
    sids = [f"s{i}" for i in range(6)]
    first = [_turn(pool, s, homes, i, 1024) for i, s in enumerate(sids)]
    second = [_turn(pool, s, homes, i, 1536) for i, s in enumerate(sids)]
    pool.mark_failed("e0")
    third = [_turn(pool, s, homes, i, 2048) for i, s in enumerate(sids)]
    return first, second, third


# s0..s5 first turns; s0..s5 again from their homes (nothing completes, in_flight
# accumulates); s0..s5 again with engine e0 unhealthy.
PINNED: dict[str, tuple[list[str], list[str], list[str]]] = {
    "sticky_cost": (
        ["e0/0", "e1/1", "e1/0", "e0/1", "e0/0", "e0/1"],
        ["e0/0", "e1/1", "e1/0", "e0/1", "e0/0", "e0/1"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/1", "e1/0"],
    ),
    "round_robin": (
        ["e0/0", "e0/1", "e1/0", "e1/1", "e0/0", "e0/1"],
        ["e1/0", "e1/1", "e0/0", "e0/1", "e1/0", "e1/1"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/0", "e1/1"],
    ),
    "consistent_hash": (
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/0", "e1/0"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/0", "e1/0"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/0", "e1/0"],
    ),
    "bounded_load": (
        ["e1/0", "e1/1", "e0/0", "e1/1", "e1/0", "e0/0"],
        ["e1/0", "e1/1", "e0/0", "e1/1", "e1/0", "e0/0"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/0", "e1/0"],
    ),
    "cache_aware": (
        ["e0/0", "e0/1", "e1/0", "e1/1", "e0/0", "e0/1"],
        ["e0/0", "e0/1", "e1/0", "e1/1", "e0/0", "e0/1"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/0", "e1/1"],
    ),
    "sticky_least_loaded": (
        ["e0/0", "e1/1", "e1/0", "e0/1", "e0/0", "e0/1"],
        ["e0/0", "e1/1", "e1/0", "e0/1", "e0/0", "e0/1"],
        ["e1/0", "e1/1", "e1/0", "e1/1", "e1/1", "e1/0"],
    ),
}

ALL = [pytest.param(name, id=name) for name in POLICY_NAMES]


@pytest.mark.parametrize("name", ALL)
def test_exact_sequence_is_pinned(name: str) -> None:
    got = _run_sequence(name)
    assert got == _run_sequence(name), f"{name}: selection is not deterministic"
    assert got == PINNED[name], f"{name}: {got}"


@pytest.mark.parametrize("name", ALL)
def test_unhealthy_targets_are_skipped(name: str) -> None:
    first, second, third = _run_sequence(name)
    assert all(t.startswith("e1/") for t in third), f"{name}: chose a target of dead e0: {third}"


@pytest.mark.parametrize("name", ALL)
def test_no_healthy_target_raises(name: str) -> None:
    pool = _pool(name)
    pool.mark_failed("e0")
    pool.mark_failed("e1")
    with pytest.raises(NoHealthyEngine):
        pool.select("s0", None, context_tokens=10)
    views = [TargetView(id="x/0", healthy=False, in_flight=0, sessions=0)]
    assert make_policy(name).select(RoutingSignals("s0", None, views)) is None, name


@pytest.mark.parametrize("name", ALL)
def test_remove_and_readd_target(name: str) -> None:
    pool = _pool(name)
    homes: dict[str, str] = {}
    for i in range(8):
        _turn(pool, f"s{i}", homes, i, 1024)
    pool.remove("e1")
    after_remove = [_turn(pool, f"s{i}", homes, i, 2048) for i in range(8)]
    assert all(t.startswith("e0/") for t in after_remove), f"{name}: {after_remove}"
    pool.add("e1", dp_size=2)
    chosen = {_turn(pool, f"n{i}", homes, 100 + i, 1024) for i in range(16)}
    assert chosen <= set(pool.targets), f"{name}: {chosen}"
    if name != "sticky_least_loaded" and name != "sticky_cost":
        return
    # Load-aware placements must use the re-added (idle) targets for new sessions.
    assert any(t.startswith("e1/") for t in chosen), f"{name}: {chosen}"


def test_factory_names_match_modules_and_reject_unknown() -> None:
    for name in POLICY_NAMES:
        policy = make_policy(name)
        assert policy.name == name
        assert type(policy).__module__ == f"session_server.routing.{name}"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(TypeError):
        make_policy("round_robin", nope=1)


def test_public_api_is_pinned() -> None:
    assert sorted(routing.__all__) == sorted(
        [
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
    )
