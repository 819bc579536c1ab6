"""Routing policy interface and the sticky least-loaded policy.

A policy is a pure object: it sees immutable `TargetView`s and an injected clock
value and returns a target id, so the same code runs in the server and in a
discrete-event simulator. One required method, `select`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TargetView:
    id: str
    healthy: bool
    in_flight: int
    sessions: int
    resident_tokens: int = 0


class RoutingPolicy(Protocol):
    name: str

    def select(
        self, session_id: str, home: str | None, targets: Sequence[TargetView], now_s: float
    ) -> str | None:
        """Target id for this session's next turn, or None when no target is healthy."""
        ...


def rendezvous_score(session_id: str, target_id: str) -> int:
    """Highest-random-weight hash: stable per (session, target), spread across targets."""
    h = hashlib.blake2b(f"{session_id}|{target_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big")


class StickyLeastLoaded:
    """Stay home while home is healthy; place by (in flight, sessions, rendezvous)."""

    name = "sticky_least_loaded"

    def select(
        self, session_id: str, home: str | None, targets: Sequence[TargetView], now_s: float
    ) -> str | None:
        healthy = [t for t in targets if t.healthy]
        if not healthy:
            return None
        if home is not None and any(t.id == home for t in healthy):
            return home
        best = min(
            healthy,
            key=lambda t: (t.in_flight, t.sessions, -rendezvous_score(session_id, t.id)),
        )
        return best.id
