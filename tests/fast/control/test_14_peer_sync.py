"""Issue 14: a starting instance takes the cluster's control state from its peers.

Pure tests of `control/peer_sync.py` over a scripted relay (no network): what is adopted
from which peers, and that a control change applied here while the peers were read is
never overwritten by that older read. The same over live servers and a real cluster:
`tests/fast/server/test_14_3_peer_sync.py`, `tests/fast/cluster/test_14_2_cluster_control.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from session_server.control.peer_sync import MAX_ROUNDS, cluster_view, sync_from_peers
from session_server.control.plane import ControlPlane
from session_server.engines.registry import EngineRegistry
from session_server.routing import EnginePool

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def state(version: int | None = None, paused: str | None = None, lora: dict[str, str] | None = None,
          synced: bool = True) -> dict[str, Any]:
    return {"weight_version": version, "paused": paused is not None, "mode": paused, "synced": synced,
            "lora_pauses": {k: {"mode": m} for k, m in (lora or {}).items()}}


class ScriptedRelay:
    """Answers `fetch` from `answers[path][peer]`; `on_fetch(n)` runs before the n-th read."""

    timeout_s = 5.0

    def __init__(self, answers: dict[str, dict[str, Any]], on_fetch: Callable[[int], None] | None = None) -> None:
        self.answers = answers
        self.on_fetch = on_fetch
        self.reads = 0

    async def fetch(self, path: str, *, timeout_s: float) -> dict[str, Any]:
        if path == "/control/state":
            self.reads += 1
            if self.on_fetch is not None:
                self.on_fetch(self.reads)
        return dict(self.answers[path])


def plane(version: int | None = None) -> ControlPlane:
    c = ControlPlane(lambda: [], grace_s=0, weight_version=version)
    c.begin_sync()
    return c


def no_engines(*peers: str) -> dict[str, Any]:
    return {p: {"engines": []} for p in peers}


def test_14_view_takes_the_highest_version_any_pause_and_skips_unsynced_or_silent_peers() -> None:
    view = cluster_view(
        {A: state(7), B: state(9, paused="keep", lora={"x": "abort"}), C: state(12, synced=False), "http://d:1": None},
        {A: {"engines": [{"protocol": "sglang", "base_url": "http://e0/"}]},
         B: {"engines": [{"protocol": "vllm", "base_url": "http://e1"}]}, C: {"engines": []}, "http://d:1": None})
    assert view.peers == [A, B]
    assert view.weight_version == 9 and view.pause_mode == "keep" and view.lora_pauses == {"x": "abort"}
    assert sorted(view.engines) == ["http://e0", "http://e1"]
    # a peer that answered one read but not the other is left out
    assert cluster_view({A: state(3)}, {A: None}).peers == []


async def test_14_sync_adopts_the_cluster_state_and_opens_the_gate() -> None:
    control = plane(version=2)
    assert control.blocked() and not control.synced and control.state()["mode"] == "sync"
    changes = control.changes
    relay = ScriptedRelay({"/control/state": {A: state(5, paused="abort"), B: state(5, paused="abort")},
                           "/engines": no_engines(A, B)})
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.adopted_from == [A, B] and out.settled and out.rounds == 1
    st = control.state()
    assert st["synced"] and st["paused"] and st["mode"] == "abort" and st["weight_version"] == 5
    assert control.changes == changes  # catching up is not a change
    # a later resume (relayed by the trainer's instance) opens it like any pause
    await control.resume()
    assert not control.blocked()


async def test_14_sync_can_take_a_version_lower_than_the_flag() -> None:
    """After a forced reset the cluster may be below this worker's start-up flag."""
    control = plane(version=40)
    relay = ScriptedRelay({"/control/state": {A: state(3)}, "/engines": no_engines(A)})
    await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert control.weight_version == 3 and not control.blocked()


async def test_14_no_peer_answers_serves_with_its_own_state() -> None:
    control = plane(version=4)
    relay = ScriptedRelay({"/control/state": {A: None, B: state(9, synced=False)}, "/engines": no_engines(A, B)})
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.adopted_from == [] and control.synced and not control.blocked() and control.weight_version == 4


async def test_14_a_change_applied_during_the_read_is_not_undone() -> None:
    """The trainer resumed (relayed here) while the peers' paused state was in transit:
    that read is dropped and the next one, which includes the resume, is adopted."""
    control = plane()
    answers = {"/control/state": {A: state(6, paused="abort")}, "/engines": no_engines(A)}

    def trainer_resumes(n: int) -> None:
        if n == 1:
            control.set_weight_version(6)  # any applied change (a relayed version, pause, resume)
            answers["/control/state"] = {A: state(6)}  # the peer resumed too: the next read says so

    relay = ScriptedRelay(answers, trainer_resumes)
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.rounds == 2 and out.settled
    assert not control.blocked() and control.weight_version == 6


async def test_14_a_relayed_pause_during_an_unanswered_sync_stays() -> None:
    control = plane()
    await control.pause("abort")  # relayed here: it replaced the sync gate before the sync ended
    relay = ScriptedRelay({"/control/state": {A: None}, "/engines": no_engines(A)})
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.adopted_from == [] and control.synced
    assert control.blocked() and control.state()["mode"] == "abort"


async def test_14_changes_that_never_stop_keep_theirs_and_only_raise_the_version() -> None:
    control = plane(version=1)
    answers = {"/control/state": {A: state(8, paused="abort")}, "/engines": no_engines(A)}
    relay = ScriptedRelay(answers, lambda n: control.set_weight_version(max(control.weight_version or 0, n)))
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert relay.reads == MAX_ROUNDS and not out.settled and out.adopted_from == []
    assert control.weight_version == 8 and control.synced and not control.blocked()  # the stale pause was not adopted


async def test_14_a_failed_sync_never_leaves_the_gate_closed() -> None:
    control = plane()

    class Fails(ScriptedRelay):
        async def fetch(self, path: str, *, timeout_s: float) -> dict[str, Any]:
            raise RuntimeError("shutdown")

    with pytest.raises(RuntimeError):
        await sync_from_peers(Fails({}), control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert control.synced and not control.blocked()
