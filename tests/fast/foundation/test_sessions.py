"""SessionStore: the in-flight gate, closing beats busy, TTL, caps, transitions."""

from __future__ import annotations

import pytest

from session_server.errors import OverCapacity, SessionBusy, SessionClosed, SessionNotFound
from session_server.sessions import IllegalTransition, SessionConfig, SessionState, SessionStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(**kw):
    clock = Clock()
    return SessionStore(clock=clock, **kw), clock


def test_ids_are_unguessable_and_unique() -> None:
    store, _ = make()
    ids = {store.create(SessionConfig(ttl_s=10)).id for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_second_claim_is_busy_and_release_only_by_owner() -> None:
    store, _ = make()
    s = store.create(SessionConfig(ttl_s=10))
    _, claim = store.claim(s.id)
    with pytest.raises(SessionBusy):
        store.claim(s.id)
    # a stale claim token (another request) cannot release it
    from session_server.sessions import Claim

    store.release(s, Claim(s.id, -1))
    assert s.inflight == claim.token
    store.release(s, claim)
    assert s.inflight is None
    store.claim(s.id)


def test_closing_beats_busy_and_blocks_commit() -> None:
    store, _ = make()
    s = store.create(SessionConfig(ttl_s=10))
    _, claim = store.claim(s.id)
    store.close(s.id)
    assert s.state is SessionState.CLOSING
    with pytest.raises(SessionNotFound):
        store.claim(s.id)  # 404, not 409
    with pytest.raises(SessionClosed):
        store.ensure_can_commit(s, claim)
    store.release(s, claim)
    assert s.state is SessionState.CLOSED
    assert len(store) == 0


def test_ttl_expiry_skips_in_flight_sessions() -> None:
    store, clock = make()
    idle = store.create(SessionConfig(ttl_s=5))
    busy = store.create(SessionConfig(ttl_s=5))
    _, claim = store.claim(busy.id)
    clock.t += 6
    assert store.expire() == [idle.id]
    with pytest.raises(SessionNotFound):
        store.get(idle.id)
    store.release(busy, claim)
    clock.t += 6
    assert store.expire() == [busy.id]


def test_session_cap() -> None:
    store, _ = make(max_sessions=2)
    store.create(SessionConfig(ttl_s=5))
    store.create(SessionConfig(ttl_s=5))
    with pytest.raises(OverCapacity):
        store.create(SessionConfig(ttl_s=5))


def test_illegal_transition_names_both_states() -> None:
    store, _ = make()
    s = store.create(SessionConfig(ttl_s=5))
    store.close(s.id)
    with pytest.raises(IllegalTransition, match="closed -> active"):
        s.transition(SessionState.ACTIVE)


def test_diagnostics_keep_the_newest_and_count_the_dropped() -> None:
    from session_server.app import session_view

    cap = 256  # the documented per-session bound
    store, _ = make()
    s = store.create(SessionConfig(ttl_s=60))
    for i in range(cap + 44):
        s.note("repair", turn=i)
    view = session_view(s)
    turns = [d["turn"] for d in view["diagnostics"]]
    assert turns == list(range(44, cap + 44))  # the newest, in order
    assert view["diagnostics_dropped"] == 44
