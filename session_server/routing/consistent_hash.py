"""`consistent_hash`: a hash ring (150 virtual nodes per target) keyed by session id.

Sticky without a table: a session maps to the first healthy target clockwise from
its hash. Load-blind, so hot sessions pile up; also owns the ring that
`bounded_load` walks.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .policy import PolicyBase, RoutingSignals, TargetView, stable_hash


@dataclass(frozen=True, slots=True)
class ConsistentHashConfig:
    vnodes: int = 150


class HashRing:
    """Sorted virtual-node points; rebuilt only when the set of target ids changes."""

    def __init__(self, vnodes: int) -> None:
        self.vnodes = vnodes
        self._ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, ids: tuple[str, ...]) -> None:
        pts = sorted((stable_hash(f"{tid}#{v}"), tid) for tid in ids for v in range(self.vnodes))
        self._ids = ids
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]

    def walk(self, key: str, targets: Sequence[TargetView]) -> Iterator[TargetView]:
        """Distinct targets in ring order clockwise from `key`'s hash."""
        ids = tuple(sorted(t.id for t in targets))
        if ids != self._ids:
            self._rebuild(ids)
        if not self._points:
            return
        by_id = {t.id: t for t in targets}
        start = bisect.bisect_right(self._points, stable_hash(key))
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield by_id[owner]
                if len(seen) == len(ids):
                    return


class ConsistentHash(PolicyBase):
    name = "consistent_hash"

    def __init__(self, config: ConsistentHashConfig | None = None) -> None:
        self.config = config or ConsistentHashConfig()
        self._ring = HashRing(self.config.vnodes)

    def select(self, signals: RoutingSignals) -> str | None:
        for t in self._ring.walk(signals.session_id, signals.targets):
            if t.healthy:
                return t.id
        return None
