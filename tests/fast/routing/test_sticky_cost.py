"""`sticky_cost` specifics: long contexts never move, re-homing spreads, no move-back."""

from __future__ import annotations

from collections import Counter

from session_server.routing import EnginePool, RoutingSignals, TargetView, make_policy


def _view(tid: str, in_flight: int = 0, **kw: int) -> TargetView:
    return TargetView(id=tid, healthy=True, in_flight=in_flight, sessions=0, **kw)


def test_long_context_never_moves_even_when_home_is_overloaded() -> None:
    policy = make_policy("sticky_cost")
    targets = [_view("a/0", in_flight=40), _view("b/0"), _view("c/0")]
    for ctx in (8192, 50_000, 100_000, None):
        got = policy.select(RoutingSignals("s", "a/0", targets, context_tokens=ctx))
        assert got == "a/0", ctx


def test_small_context_migrates_only_past_both_guards() -> None:
    policy = make_policy("sticky_cost")
    hot = [_view("a/0", in_flight=10), _view("b/0", in_flight=1)]
    assert policy.select(RoutingSignals("s", "a/0", hot, context_tokens=2000)) == "b/0"
    # >= 8 more in flight but not 2x the least loaded: stay.
    warm = [_view("a/0", in_flight=18), _view("b/0", in_flight=10)]
    assert policy.select(RoutingSignals("s", "a/0", warm, context_tokens=2000)) == "a/0"
    # 2x but fewer than 8 more: stay.
    mild = [_view("a/0", in_flight=6), _view("b/0", in_flight=1)]
    assert policy.select(RoutingSignals("s", "a/0", mild, context_tokens=2000)) == "a/0"


def test_placement_prefers_low_pending_prefill_and_respects_kv_barrier() -> None:
    policy = make_policy("sticky_cost", prefill_tokens_per_s=1000.0)
    targets = [
        _view("a/0", pending_prefill_tokens=80_000),
        _view("b/0", resident_tokens=950_000, kv_capacity_tokens=1_000_000),
        _view("c/0", in_flight=3),
    ]
    assert policy.select(RoutingSignals("s", None, targets, context_tokens=30_000)) == "c/0"


def test_dead_engine_sessions_spread_across_survivors_and_never_move_back() -> None:
    pool = EnginePool(make_policy("sticky_cost", prefill_tokens_per_s=5000.0), clock=lambda: 0.0)
    for e in ("e0", "e1", "e2"):
        pool.add(e, dp_size=2)
    homes: dict[str, str] = {}
    for i in range(24):
        t = pool.select(f"s{i}", None, context_tokens=4000)
        pool.on_turn_complete(t, f"s{i}", ok=True, total_tokens=50_000)
        homes[f"s{i}"] = t.id
    orphans = [s for s, h in homes.items() if h.startswith("e0/")]
    assert len(orphans) == 8
    pool.mark_failed("e0")
    new_homes = {}
    for s in orphans:
        t = pool.select(s, homes[s], context_tokens=52_000)
        t.in_flight += 1  # still prefilling when the next orphan arrives
        new_homes[s] = t.id
    spread = Counter(new_homes.values())
    assert not any(h.startswith("e0/") for h in spread)
    assert len(spread) == 4 and max(spread.values()) == 2, spread
    assert pool.rehomes == 8 and pool.migrations == 0
    for s, h in new_homes.items():
        pool.on_turn_complete(pool.targets[h], s, ok=True, total_tokens=53_000)
        pool.targets[h].in_flight -= 1
    pool.mark_healthy("e0")
    for s, h in new_homes.items():
        assert pool.select(s, h, context_tokens=54_000).id == h, s
    assert pool.migrations == 0
    # The recovered engine takes new sessions (it is the cheapest now).
    assert pool.select("fresh", None, context_tokens=4000).engine_id == "e0"


def test_pool_tracks_pending_and_resident_tokens() -> None:
    pool = EnginePool(make_policy("sticky_cost"), clock=lambda: 0.0)
    pool.add("e0", dp_size=1)
    t = pool.select("s", None, context_tokens=1000)
    assert t.pending_prefill_tokens == 1000
    pool.on_turn_complete(t, "s", ok=True, total_tokens=1200)
    assert (t.pending_prefill_tokens, t.resident_tokens) == (0, 1200)
    t = pool.select("s", t.id, context_tokens=1500)
    assert t.pending_prefill_tokens == 300
    # A retry re-selects without completing: the first estimate is released.
    t = pool.select("s", t.id, context_tokens=1500)
    assert t.pending_prefill_tokens == 300
    pool.on_turn_complete(t, "s", ok=False)
    assert (t.pending_prefill_tokens, t.resident_tokens) == (0, 1200)
    pool.forget("s", t.id)
    assert (t.resident_tokens, len(t.sessions)) == (0, 0)


def test_legacy_select_without_signals_still_works() -> None:
    pool = EnginePool(clock=lambda: 0.0)
    pool.add("e0", dp_size=2)
    a = pool.select("s0", None)
    assert pool.select("s0", a.id) is a
    assert a.pending_prefill_tokens == 0
