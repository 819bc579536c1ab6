"""`cache_aware`: SGLang router's policy over an approximate per-target prefix tree.

Per target, an LRU set of chained prefix-block hashes (what the router has sent
there, not what the engine really holds). If load is imbalanced
(max - min > balance_abs_threshold and max > min * balance_rel_threshold) the
least-loaded target wins; else the target with the longest matched prefix wins
when matched / total > cache_threshold, otherwise the target with the smallest
tree. Defaults are the SGLang CLI's (the Rust defaults are 0.5 / 32 / 1.1).
Needs `RoutingSignals.prefix_hashes`; without them every request is a miss.
Load is `placement_load` (ours plus the engine-reported rest): SGLang's
router sees every request because it is the only router; N instances see each
other's work only through the engines' own reports.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .policy import PolicyBase, RoutingSignals, healthy_targets


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_blocks: int = 1 << 16


class CacheAware(PolicyBase):
    name = "cache_aware"
    needs_prefix_hashes = True

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def _tree(self, target_id: str) -> OrderedDict[int, None]:
        return self._trees.setdefault(target_id, OrderedDict())

    def _matched(self, target_id: str, hashes: tuple[int, ...]) -> int:
        tree = self._trees.get(target_id)
        if not tree:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, target_id: str, hashes: tuple[int, ...]) -> None:
        tree = self._tree(target_id)
        # Touch from the tail so the prefix is most recent: LRU evicts leaves first.
        for h in reversed(hashes):
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.config.max_tree_blocks:
            tree.popitem(last=False)

    def select(self, signals: RoutingSignals) -> str | None:
        healthy = healthy_targets(signals)
        if not healthy:
            return None
        cfg = self.config
        hashes = tuple(signals.prefix_hashes or ())
        loads = [t.placement_load for t in healthy]
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            choice = min(healthy, key=lambda t: t.placement_load).id
        else:
            best_id, best_n = healthy[0].id, -1
            for t in healthy:
                n = self._matched(t.id, hashes)
                if n > best_n:
                    best_id, best_n = t.id, n
            rate = best_n / len(hashes) if hashes else 0.0
            if rate > cfg.cache_threshold:
                choice = best_id
            else:
                choice = min(healthy, key=lambda t: len(self._trees.get(t.id, ()))).id
        self._insert(choice, hashes)
        return choice

    def on_target_removed(self, target_id: str) -> None:
        self._trees.pop(target_id, None)
