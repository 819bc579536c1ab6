"""The staleness bound of one turn (`max_weight_lag`).

`max_weight_lag=K` bounds how many weight versions a turn's sampled tokens may span:
K=1 means every token comes from one version, K=2 allows one update, None (the
default) is unbounded. A turn that would cross the bound is ended at the update
(finish `abort`, flagged with `stale_bound`, its partial tokens kept with their
versions) instead of being resubmitted under the new weights.

Two places can cross it, both checked here for `generate_resilient`:

- A resubmission (after an `abort` pause): the segment would be sampled with the
  plane's current version. When the tokens kept so far plus that version make more
  than K, the turn ends before the segment is sent. A turn with no kept token spans
  no version yet, so it is resubmitted, never ended (0 partial tokens).
- A segment in flight across an update (a `keep` pause freezes it; the engine would
  continue it with the new weights): when the turn's versions, the segment's own and
  the new one make more than K, the segment is aborted at the engine at the update
  (`ControlPlane.abort_engine_request`; `resume` waits for that abort), so its tokens were
  all sampled before the update and are attributed to its dispatch version; the
  resubmission check then ends the turn. If the engine still samples after the update
  before the abort lands (the version was set after `resume`, or the engine cannot
  abort), those tokens carry the version the engine says sampled them where it reports
  per-token spans (vLLM 0.32), else the dispatch version: the bound is exact only when
  the version is set while the engines are paused, as docs/api.md says to.

Versions compare as strings (SGLang reports "2" for the plane's 2); an unknown version
(None: no `POST /control/weight_version` and no engine report) is not counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .plane import ControlPlane

__all__ = ["LagBound", "SegmentWatch"]


def _key(version: Any) -> str | None:
    return None if version is None else str(version)


@dataclass
class SegmentWatch:
    """One segment in flight: the versions it may have sampled with, and whether it was cut."""

    versions: list[Any]
    cut: bool = False


@dataclass
class LagBound:
    """The versions a turn's kept tokens may span, against its bound `k` (None: unbounded)."""

    k: int | None
    seen: dict[str, Any] = field(default_factory=dict)  # key -> version as first seen

    def _exceeds(self, *versions: Any) -> bool:
        if self.k is None:
            return False
        keys = set(self.seen) | {k for k in map(_key, versions) if k is not None}
        return len(keys) > self.k

    def keep(self, *versions: Any) -> None:
        """Kept tokens were sampled with (some of) `versions`."""
        for v in versions:
            k = _key(v)
            if k is not None:
                self.seen.setdefault(k, v)

    def ends_before(self, kept_tokens: int, next_version: Any) -> bool:
        """Whether a resubmission sampled with `next_version` would cross the bound."""
        return kept_tokens > 0 and self._exceeds(next_version)

    def flag(self, next_version: Any) -> dict[str, Any]:
        """The turn record's `stale_bound` flag: the bound, the versions its tokens span
        and the version it was not continued under."""
        return {"max_weight_lag": self.k, "versions": list(self.seen.values()), "next_version": next_version}

    @contextmanager
    def watch(self, control: ControlPlane, adapter: Any, rid: str, dispatch_version: Any) -> Iterator[SegmentWatch]:
        """While segment `rid` is at the engine: on an update that would take the turn past
        the bound, abort it at the engine (`cut`); else note the new version as one its
        tokens may span (a frozen `keep` segment continues with it). Unbounded: a no-op."""
        seg = SegmentWatch([dispatch_version])
        if self.k is None:
            yield seg
            return

        def on_update(version: int) -> None:
            if seg.cut:
                return
            if self._exceeds(*seg.versions, version):
                seg.cut = True
                control.abort_engine_request(adapter, rid)  # `resume` waits for it to land
            else:
                seg.versions.append(version)

        control.on_weight_version.append(on_update)  # bounded turns only: the list stays short
        try:
            yield seg
        finally:
            control.on_weight_version.remove(on_update)
