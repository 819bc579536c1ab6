"""A starting instance takes the cluster's control state from its peers.

Pure tests of `control/peer_sync.py` over a scripted relay (no network): what is adopted
from which peers, and that a control change applied here while the peers were read is
never overwritten by that read, even when a peer had not applied it yet. The same over
live servers and a real cluster: `tests/fast/control/test_peer_sync_live.py`,
`tests/fast/cluster/test_cluster_control.py`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from session_server.control.peer_sync import cluster_view, sync_from_peers
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

    async def fetch(self, path: str, *, timeout_s: float, misses: dict[str, str] | None = None) -> dict[str, Any]:
        if path == "/control/state":
            self.reads += 1
            if self.on_fetch is not None:
                self.on_fetch(self.reads)
        await asyncio.sleep(0.01)  # the read takes a while: what `on_fetch` started runs meanwhile
        return dict(self.answers[path])


def plane(version: int | None = None) -> ControlPlane:
    c = ControlPlane(lambda: [], grace_s=0, weight_version=version)
    c.begin_sync()
    return c


def no_engines(*peers: str) -> dict[str, Any]:
    return {p: {"engines": []} for p in peers}


def test_view_takes_the_highest_version_any_pause_and_skips_unsynced_or_silent_peers() -> None:
    view = cluster_view(
        {A: state(7), B: state(9, paused="keep", lora={"x": "abort"}), C: state(12, synced=False), "http://d:1": None},
        {A: {"engines": [{"protocol": "sglang", "base_url": "http://e0/"}]},
         B: {"engines": [{"protocol": "vllm", "base_url": "http://e1"}]}, C: {"engines": []}, "http://d:1": None})
    assert view.peers == [A, B]
    assert view.weight_version == 9 and view.pause_mode == "keep" and view.lora_pauses == {"x": "abort"}
    assert sorted(view.engines) == ["http://e0", "http://e1"]
    # a peer that answered one read but not the other is left out
    assert cluster_view({A: state(3)}, {A: None}).peers == []


async def test_sync_adopts_the_cluster_state_and_opens_the_gate() -> None:
    control = plane(version=2)
    assert control.blocked() and not control.synced
    relay = ScriptedRelay({"/control/state": {A: state(5, paused="abort"), B: state(5, paused="abort")},
                           "/engines": no_engines(A, B)})
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.adopted_from == [A, B]
    st = control.state()
    assert st["synced"] and st["paused"] and st["mode"] == "abort" and st["weight_version"] == 5
    assert st["counters"]["pauses"] == 0  # adopted, not paused here: no engine was asked
    # a later resume (relayed by the trainer's instance) opens it like any pause
    await control.resume()
    assert not control.blocked()


async def test_sync_can_take_a_version_lower_than_the_flag() -> None:
    """After a forced reset the cluster may be below this worker's start-up flag."""
    control = plane(version=40)
    relay = ScriptedRelay({"/control/state": {A: state(3)}, "/engines": no_engines(A)})
    await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert control.weight_version == 3 and not control.blocked()


async def test_no_peer_answers_serves_with_its_own_state() -> None:
    control = plane(version=4)
    relay = ScriptedRelay({"/control/state": {A: None, B: state(9, synced=False)}, "/engines": no_engines(A, B)})
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.adopted_from == [] and control.synced and not control.blocked() and control.weight_version == 4


async def test_a_resume_relayed_during_the_read_wins_over_a_peer_still_paused() -> None:
    """The trainer resumed while the joining instance read its peers; A (the sender) and
    B were still in their resume fan-out, so both still answered "paused". The resume
    applied here is newer than that read and is kept; the gate stays closed until the
    sync ends even though the resume cleared the pause."""
    control = plane(version=1)

    def trainer_acts(n: int) -> None:
        loop = asyncio.get_running_loop()
        resumed.append(loop.create_task(control.resume()))
        control.set_weight_version(7, force=True)  # a forced reset, relayed here too

    resumed: list[asyncio.Task[Any]] = []
    relay = ScriptedRelay({"/control/state": {A: state(9, paused="abort"), B: state(9, paused="abort")},
                           "/engines": no_engines(A, B)}, trainer_acts)
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert resumed[0].done()  # applied during the read, before the adoption
    assert out.adopted_from == [A, B]
    assert not control.state()["paused"] and not control.blocked()
    assert control.weight_version == 7  # the reset, not the peers' older 9


async def test_the_gate_stays_closed_until_the_sync_ends_whatever_is_relayed() -> None:
    control = plane()
    await control.pause("abort")
    await control.resume()
    assert control.blocked() and not control.synced  # a relayed resume does not open a joining gate
    control.end_sync()
    assert not control.blocked()


async def test_lora_pauses_relayed_during_the_read_are_kept_the_others_adopted() -> None:
    control = plane()
    await control.pause("keep", lora="mine")
    relay = ScriptedRelay({"/control/state": {A: state(2, lora={"theirs": "abort"})}, "/engines": no_engines(A)})
    await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert control.state()["lora_pauses"].keys() == {"mine", "theirs"}
    assert control.state()["lora_pauses"]["mine"]["mode"] == "keep"


async def test_a_relayed_pause_during_an_unanswered_sync_stays() -> None:
    control = plane()
    await control.pause("abort")  # relayed here while the peers did not answer
    relay = ScriptedRelay({"/control/state": {A: None}, "/engines": no_engines(A)})
    out = await sync_from_peers(relay, control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert out.adopted_from == [] and control.synced
    assert control.blocked() and control.state()["mode"] == "abort"


class FakeAdapter:
    def __init__(self, url: str) -> None:
        self.base_url, self.protocol = url, "sglang"

    async def aclose(self) -> None:
        return None


def registry_with(*urls: str) -> EngineRegistry:
    reg = EngineRegistry(EnginePool())
    for i, u in enumerate(urls):
        reg.attach(f"e{i}", FakeAdapter(u), 1)  # type: ignore[arg-type]
    return reg


async def test_engines_peers_have_are_added_and_those_none_has_removed() -> None:
    reg = registry_with("http://old", "http://both")
    added: list[str] = []

    async def add(spec: str, *, dp_size: int | None = None) -> Any:
        url = spec.split("=", 1)[1]
        added.append(spec)
        return reg.attach(f"n{len(added)}", FakeAdapter(url), dp_size or 1)  # type: ignore[arg-type]

    reg.add = add  # type: ignore[method-assign]
    engines = {A: {"engines": [{"protocol": "sglang", "base_url": "http://both"},
                               {"protocol": "vllm", "base_url": "http://new/", "dp_size": 2}]}}
    out = await sync_from_peers(ScriptedRelay({"/control/state": {A: state()}, "/engines": engines}),
                                plane(), reg)  # type: ignore[arg-type]
    assert added == ["vllm=http://new"] and out.added == ["http://new"] and out.removed == ["http://old"]
    assert sorted(a.base_url for a in reg.adapters()) == ["http://both", "http://new"]
    assert reg.pool.engines["n1"].dp_size == 2


async def test_an_engine_removed_by_the_cluster_while_it_was_being_added_is_not_kept() -> None:
    """The relayed DELETE lands while the sync's add awaits the engine: it found nothing
    (404, acknowledged) and must still win over the sync's older read."""
    reg = registry_with()

    async def slow_add(spec: str, *, dp_size: int | None = None) -> Any:
        reg.note("http://gone", "removed")  # the relayed removal, noted by the route
        return reg.attach("e9", FakeAdapter("http://gone"), 1)  # type: ignore[arg-type]

    reg.add = slow_add  # type: ignore[method-assign]
    engines = {A: {"engines": [{"protocol": "sglang", "base_url": "http://gone"}]}}
    out = await sync_from_peers(ScriptedRelay({"/control/state": {A: state()}, "/engines": engines}),
                                plane(), reg)  # type: ignore[arg-type]
    assert reg.adapters() == [] and out.added == []


async def test_engines_asked_for_during_the_sync_are_left_as_asked() -> None:
    reg = registry_with("http://kept")
    relay = ScriptedRelay({"/control/state": {A: state()}, "/engines": {A: {"engines": [
        {"protocol": "sglang", "base_url": "http://dropped"}]}}},
        lambda n: (reg.note("sglang=http://kept", "added"), reg.note("http://dropped", "removed")))
    out = await sync_from_peers(relay, plane(), reg)  # type: ignore[arg-type]
    assert [a.base_url for a in reg.adapters()] == ["http://kept"] and out.added == out.removed == []


async def test_one_engine_that_fails_to_add_does_not_stop_the_join() -> None:
    reg = registry_with()

    async def broken(spec: str, *, dp_size: int | None = None) -> Any:
        raise ConnectionResetError("engine went away")

    reg.add = broken  # type: ignore[method-assign]
    control = plane()
    engines = {A: {"engines": [{"protocol": "sglang", "base_url": "http://x"}]}}
    await sync_from_peers(ScriptedRelay({"/control/state": {A: state(6, paused="keep")}, "/engines": engines}),
                          control, reg)  # type: ignore[arg-type]
    assert control.weight_version == 6 and control.state()["paused"]  # the rest was adopted


async def test_a_failed_sync_never_leaves_the_gate_closed() -> None:
    control = plane()

    class Fails(ScriptedRelay):
        async def fetch(self, path: str, *, timeout_s: float, misses: dict[str, str] | None = None) -> dict[str, Any]:
            raise RuntimeError("shutdown")

    with pytest.raises(RuntimeError):
        await sync_from_peers(Fails({}), control, EngineRegistry(EnginePool()))  # type: ignore[arg-type]
    assert control.synced and not control.blocked()


async def test_a_peer_not_up_yet_is_one_short_line_not_a_connection_error(caplog: pytest.LogCaptureFixture) -> None:
    """The first worker of a cluster to come up finds the others not listening yet: that
    is expected, so it is one short INFO line naming them and why, not two lines per peer
    of aiohttp's three-hundred-character `ClientConnectorError(ConnectionKey(...))`."""
    import socket
    from types import SimpleNamespace

    from session_server.control.relay import PeerRelay
    from session_server.lifecycle import _sync

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    relay = PeerRelay([down], timeout_s=5.0)
    ctx = SimpleNamespace(control=plane(), registry=EngineRegistry(EnginePool()),
                          settings=SimpleNamespace(turn_timeout_s=1.0))
    try:
        with caplog.at_level("DEBUG", logger="session_server"):
            await _sync(relay, ctx)  # type: ignore[arg-type]
    finally:
        await relay.aclose()
    assert ctx.control.synced
    shown = [r for r in caplog.records if r.levelname != "DEBUG"]
    assert [r.getMessage() for r in shown] == [
        f"no peer answered ({down} connection refused): serving with this instance's own state"]
    assert all(r.levelname == "INFO" for r in shown)


async def test_many_peers_not_up_yet_are_still_one_short_line(caplog: pytest.LogCaptureFixture) -> None:
    """The first worker of a large cluster finds every other worker down: its line names
    the first few of them and counts the rest, so it stays one short line (a cluster's
    start log keeps every line under 400 characters) whatever the cluster's size."""
    import socket
    from types import SimpleNamespace

    from session_server.control.relay import PeerRelay
    from session_server.lifecycle import PEERS_NAMED, _sync

    down = []
    for _ in range(12):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            down.append(f"http://127.0.0.1:{s.getsockname()[1]}")  # nothing listens once closed
    relay = PeerRelay(down, timeout_s=5.0)
    ctx = SimpleNamespace(control=plane(), registry=EngineRegistry(EnginePool()),
                          settings=SimpleNamespace(turn_timeout_s=1.0))
    try:
        with caplog.at_level("INFO", logger="session_server"):
            await _sync(relay, ctx)  # type: ignore[arg-type]
    finally:
        await relay.aclose()
    (line,) = [r.getMessage() for r in caplog.records if r.levelname != "DEBUG"]
    assert len(line) < 300 and "\n" not in line, line
    assert f"and {len(down) - PEERS_NAMED} more" in line, line
    assert sum(url in line for url in down) == PEERS_NAMED, line
