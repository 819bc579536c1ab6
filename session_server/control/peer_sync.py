"""A starting instance takes the cluster's control state from its peers (issue 14).

A worker that restarts (the cluster supervisor's, a Kubernetes pod) comes back with
its command line's state: not paused, the flag's weight version (or none), the flag's
engines. The cluster may have moved on: paused for an update, at weight version 57,
with engines added or removed at runtime. A turn run on the stale state would be
stamped with the wrong version or sent to paused or retired engines. So an instance
with peers starts with its gate closed and `/health` answering 503 (the proxy sends it
nothing) until it has read its peers' `/control/state` and `/engines` and adopted:

- the weight version: the highest any peer reports;
- the pause: paused (with that peer's mode) when any peer is paused globally, and
  every LoRA adapter any peer has paused;
- the engines: every engine a peer has (by URL) is added here, and an engine here
  that no peer has was removed at runtime and is removed here.

Peers still syncing themselves (`synced: false`) and peers that do not answer are left
out; with none left there is nothing to adopt and the gate opens as it is.

The instance listens while it syncs, so a control request relayed to it meanwhile is
applied here. Such a change (counted by `ControlPlane.changes` / `EngineRegistry.changes`)
makes the sync read its peers again rather than overwrite it with an older read: a
peer relays every change to this instance too, so the re-read already includes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..engines.registry import EngineRegistry
from ..errors import BadRequest
from .plane import PAUSE_MODES, ControlPlane
from .relay import PeerRelay

__all__ = ["ClusterView", "SyncOutcome", "cluster_view", "sync_from_peers"]

log = logging.getLogger(__name__)

MAX_ROUNDS = 8  # reads that a concurrent change may invalidate before the sync settles for the last one
READ_TIMEOUT_S = 10.0  # per peer read; never longer than the relay's own timeout


@dataclass
class ClusterView:
    """The state adopted from the peers that answered (see the module doc)."""

    peers: list[str]
    weight_version: int | None = None
    pause_mode: str | None = None
    lora_pauses: dict[str, str] = field(default_factory=dict)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # base_url -> peer's view of it


@dataclass
class SyncOutcome:
    adopted_from: list[str]
    rounds: int
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    settled: bool = True  # False: changes kept arriving; the last read was adopted

    def as_dict(self) -> dict[str, Any]:
        return {"adopted_from": self.adopted_from, "rounds": self.rounds, "added": self.added,
                "removed": self.removed, "settled": self.settled}


def cluster_view(states: dict[str, Any], engines: dict[str, Any]) -> ClusterView:
    """Merge what the peers answered; a peer counts only with both answers and synced."""
    view = ClusterView(peers=[])
    for peer, st in states.items():
        eng = engines.get(peer)
        if not isinstance(st, dict) or not isinstance(eng, dict) or st.get("synced") is False:
            continue
        view.peers.append(peer)
        v = st.get("weight_version")
        if isinstance(v, int) and not isinstance(v, bool) and (view.weight_version is None or v > view.weight_version):
            view.weight_version = v
        mode = st.get("mode")
        if st.get("paused") and view.pause_mode is None and mode in PAUSE_MODES:
            view.pause_mode = mode
        for name, lp in (st.get("lora_pauses") or {}).items():
            if isinstance(lp, dict) and lp.get("mode") in PAUSE_MODES:
                view.lora_pauses.setdefault(name, lp["mode"])
        for e in eng.get("engines") or ():
            if isinstance(e, dict) and isinstance(e.get("base_url"), str) and isinstance(e.get("protocol"), str):
                view.engines.setdefault(e["base_url"].rstrip("/"), e)
    return view


async def _read(relay: PeerRelay) -> ClusterView:
    timeout_s = min(READ_TIMEOUT_S, relay.timeout_s)
    states = await relay.fetch("/control/state", timeout_s=timeout_s)
    engines = await relay.fetch("/engines", timeout_s=timeout_s)
    return cluster_view(states, engines)


async def _reconcile_engines(registry: EngineRegistry, view: ClusterView, drain_s: float,
                             outcome: SyncOutcome) -> int:
    """Add the peers' engines this instance lacks; remove those no peer has; how many."""
    made = 0
    for url, e in view.engines.items():
        if registry.find(url) is not None:
            continue
        dp = e.get("dp_size")
        try:
            await registry.add(f"{e['protocol']}={url}", dp_size=dp if isinstance(dp, int) and dp >= 1 else None)
            outcome.added.append(url)
            made += 1
        except BadRequest as exc:  # refuses to be an engine now: the health of it is the peers' concern
            log.warning("peer sync: engine %s that peers use refused here: %s", url, exc)
    for engine_id, adapter in [(a_id, registry.adapter(a_id)) for a_id in list(registry.pool.engines)]:
        if adapter.base_url.rstrip("/") not in view.engines:
            registry.remove(engine_id, drain_s=drain_s)
            outcome.removed.append(adapter.base_url)
            made += 1
    return made


async def sync_from_peers(relay: PeerRelay, control: ControlPlane, registry: EngineRegistry, *,
                          drain_s: float = 0.0) -> SyncOutcome:
    """Adopt the cluster's state (module doc); the caller has called `control.begin_sync()`.

    Never raises for a peer: one that fails is left out. Always leaves the gate synced.
    When changes keep arriving for `MAX_ROUNDS` reads, no read is adopted but its weight
    version, if higher (versions only grow): the relayed changes are the newer state."""
    outcome = SyncOutcome(adopted_from=[], rounds=0)
    try:
        for rounds in range(1, MAX_ROUNDS + 1):
            outcome.rounds = rounds
            mark = (control.changes, registry.changes)
            view = await _read(relay)
            if (control.changes, registry.changes) != mark:
                continue  # a change reached this instance while it read: read again
            if not view.peers:
                return outcome
            # engines first, behind the closed gate: no turn runs before both are in step
            made = await _reconcile_engines(registry, view, drain_s, outcome)
            if (control.changes, registry.changes - made) != mark:
                continue  # a relayed change landed meanwhile: read again (engine changes are idempotent)
            control.adopt(weight_version=view.weight_version, pause_mode=view.pause_mode,
                          lora_pauses=view.lora_pauses)  # no await between the check and this
            outcome.adopted_from = view.peers
            return outcome
        outcome.settled = False
        log.warning("peer sync: control changes kept arriving during %d reads of the peers; keeping them", MAX_ROUNDS)
        if view.weight_version is not None and (control.weight_version is None
                                                or view.weight_version > control.weight_version):
            control.set_weight_version(view.weight_version)
        return outcome
    finally:
        if not control.synced:
            control.end_sync()
