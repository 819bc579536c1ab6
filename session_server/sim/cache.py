"""Per-DP-rank prefix cache of the simulator: paged, chained-hash keys, token capacity, LRU.

A page key is hash(parent key, page tokens), so a lookup walks the prompt page by
page like a radix tree walk. Pages are touched leaf-first, so the LRU end holds
leaves and eviction never strands a reachable chain before its descendants.
`cached_tokens` never covers the whole prompt: engines always compute the last
token (SGLang reports 49 cached of a 50-token prompt).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixCache"]


class PrefixCache:
    """One DP rank's KV prefix cache (page_size 1 = SGLang's radix; 16 = vLLM blocks)."""

    def __init__(self, capacity_tokens: int = 1 << 20, page_size: int = 1) -> None:
        if page_size < 1 or capacity_tokens < page_size:
            raise ValueError("need page_size >= 1 and capacity_tokens >= page_size")
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self._pages: OrderedDict[int, None] = OrderedDict()
        self.queries_tokens = 0  # vLLM's prefix_cache_queries_total
        self.hits_tokens = 0  # vLLM's prefix_cache_hits_total

    @property
    def used_tokens(self) -> int:
        return len(self._pages) * self.page_size

    def _keys(self, ids: Sequence[int], salt: str | None) -> list[int]:
        ps = self.page_size
        keys: list[int] = []
        # the salt roots the hash chain: pages cached under another salt never match
        parent = 0 if salt is None else hash(("salt", salt))
        for start in range(0, len(ids) - ps + 1, ps):
            parent = hash((parent, tuple(ids[start : start + ps])))
            keys.append(parent)
        return keys

    def _touch(self, keys: list[int]) -> None:
        for k in reversed(keys):
            self._pages.move_to_end(k)

    def match(self, ids: Sequence[int], salt: str | None = None) -> int:
        """Cached prefix length of `ids` under `salt` (at most len(ids) - 1); one query."""
        hit: list[int] = []
        for k in self._keys(ids, salt):
            if k not in self._pages:
                break
            hit.append(k)
        self._touch(hit)
        cached = min(len(hit) * self.page_size, max(0, len(ids) - 1))
        self.queries_tokens += len(ids)
        self.hits_tokens += cached
        return cached

    def insert(self, ids: Sequence[int], salt: str | None = None) -> None:
        """Cache every full page of `ids` (prompt + output after a request), then evict LRU."""
        keys = self._keys(ids, salt)
        for k in keys:
            self._pages[k] = None
        self._touch(keys)
        max_pages = self.capacity_tokens // self.page_size
        while len(self._pages) > max_pages:
            self._pages.popitem(last=False)

    def flush(self) -> None:
        self._pages.clear()
