"""A starting instance takes the cluster's control state from its peers.

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
applied here (pause and resume reach the engines as usual). What such a request set
(the global pause, one LoRA adapter's, the version, one engine URL) is newer than any
read of the peers that overlaps it (a peer may not have applied it yet when read), so
`adopt` and the engine reconciliation keep it: only what no request touched is taken
from the peers. A change whose relay to this instance failed (the trainer's 207 names
it) is only as current here as the peers were when read: resend it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ..engines.registry import EngineRegistry
from .plane import MAX_WEIGHT_VERSION, PAUSE_MODES, ControlPlane
from .relay import PeerRelay

__all__ = ["ClusterView", "SyncOutcome", "cluster_view", "sync_from_peers"]

log = logging.getLogger(__name__)

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
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unanswered: dict[str, str] = field(default_factory=dict)  # peer -> why, in a few words

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"adopted_from": self.adopted_from, "added": self.added, "removed": self.removed}
        if self.unanswered:
            out["unanswered"] = self.unanswered
        return out


def cluster_view(states: dict[str, Any], engines: dict[str, Any]) -> ClusterView:
    """Merge what the peers answered; a peer counts only with both answers and synced."""
    view = ClusterView(peers=[])
    for peer, st in states.items():
        eng = engines.get(peer)
        if not isinstance(st, dict) or not isinstance(eng, dict) or st.get("synced") is False:
            continue
        view.peers.append(peer)
        v = st.get("weight_version")
        if (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_WEIGHT_VERSION
                and (view.weight_version is None or v > view.weight_version)):
            view.weight_version = v
        mode = st.get("mode")
        if st.get("paused") and view.pause_mode is None and mode in PAUSE_MODES:
            view.pause_mode = mode
        loras = st.get("lora_pauses")
        for name, lp in (loras.items() if isinstance(loras, dict) else ()):
            if isinstance(lp, dict) and lp.get("mode") in PAUSE_MODES:
                view.lora_pauses.setdefault(name, lp["mode"])
        engs = eng.get("engines")
        for e in (engs if isinstance(engs, list) else ()):
            if isinstance(e, dict) and isinstance(e.get("base_url"), str) and isinstance(e.get("protocol"), str):
                view.engines.setdefault(e["base_url"].rstrip("/"), e)
    return view


async def _read(relay: PeerRelay, misses: dict[str, str]) -> ClusterView:
    timeout_s = min(READ_TIMEOUT_S, relay.timeout_s)
    states, engines = await asyncio.gather(relay.fetch("/control/state", timeout_s=timeout_s, misses=misses),
                                           relay.fetch("/engines", timeout_s=timeout_s, misses=misses))
    return cluster_view(states, engines)


async def _reconcile_engines(registry: EngineRegistry, view: ClusterView, noted: dict[str, str],
                             drain_s: float, outcome: SyncOutcome) -> None:
    """Add the peers' engines this instance lacks; remove those no peer has. A URL an
    add or remove was asked for here since the sync began (`noted`) is left as asked."""
    for url, e in view.engines.items():
        if url in noted or registry.find(url) is not None:
            continue
        dp = e.get("dp_size")
        try:
            eng = await registry.add(f"{e['protocol']}={url}", dp_size=dp if isinstance(dp, int) and dp >= 1 else None)
        except Exception as exc:  # one engine never stops the rest of the join; the peers own its health
            log.warning("peer sync: could not add engine %s that peers use: %r", url, exc)
            continue
        if noted.get(url) == "removed":  # the cluster removed it while it was being added here
            registry.remove(eng.id, drain_s=0.0)
            continue
        outcome.added.append(url)
    for engine_id in list(registry.pool.engines):
        url = registry.adapter(engine_id).base_url.rstrip("/")
        if url not in view.engines and url not in noted:
            registry.remove(engine_id, drain_s=drain_s)
            outcome.removed.append(url)


async def sync_from_peers(relay: PeerRelay, control: ControlPlane, registry: EngineRegistry, *,
                          drain_s: float = 0.0) -> SyncOutcome:
    """Adopt the cluster's state (module doc); the caller has called `control.begin_sync()`.

    Never raises for a peer: one that fails is left out. Always leaves the gate open
    (synced), whatever happens; engines are reconciled before it opens."""
    outcome = SyncOutcome(adopted_from=[])
    noted = registry.note_changes()
    try:
        view = await _read(relay, outcome.unanswered)
        if not view.peers:
            return outcome
        await _reconcile_engines(registry, view, noted, drain_s, outcome)
        control.adopt(weight_version=view.weight_version, pause_mode=view.pause_mode,
                      lora_pauses=view.lora_pauses)
        outcome.adopted_from = view.peers
        return outcome
    finally:
        registry.stop_noting()
        if not control.synced:
            control.end_sync()
