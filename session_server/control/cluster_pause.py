"""A `wait` pause over instances that share engines: every instance drains, then all freeze.

SGLang has no drain mode: a `wait` pause drains this instance's own requests with the
gate closed, then freezes the engine in place (`pause_generation {"mode": "in_place"}`,
fanout.py). The engines are shared by every instance of a cluster, so an instance that
froze an engine as soon as its own turns were done would freeze its peers' turns under
them: their drains would never finish, and after the weight update those turns would
go on under the new weights, stamped as the old. So the pause runs in two phases, each
sent to every instance at once (relayed with `?phase=`, control/relay.py):

1. `drain`: each instance closes its gate (no new segment starts anywhere) and waits,
   up to its `drain_timeout_s`, for its own segments to leave the engines. No engine
   is paused yet, so every instance's turns run to their end under the old weights.
2. `freeze`: only when every instance answered drained, each pauses the engines it
   knows (SGLang `in_place`, vLLM `wait`: nothing of ours is left on them).

A drain that timed out anywhere ends the pause there: no engine is paused, every gate
stays closed (turns still in flight run on; none starts), and the answer is a 504
`drain_timeout` carrying the report (what each instance had left). The trainer then
pauses again (`wait` drains what is left; `abort` cuts it) or resumes. A peer that
refused the connection is down (its turns died with it): it is named in
`failed_instances` and the pause goes on (207). A peer that answered neither (timed
out, failed) may still run turns on the engines: nothing is frozen (504).
"""

from __future__ import annotations

import asyncio
from typing import Any

from session_server.errors import DrainTimeout, PauseSuperseded

from .plane import ControlPlane
from .relay import PeerRelay, merge_instances

__all__ = ["phase_response", "wait_pause"]

DRAIN_PATH = "/control/pause?phase=drain"
FREEZE_PATH = "/control/pause?phase=freeze"


def phase_response(report: dict[str, Any]) -> dict[str, Any]:
    """One instance's own `wait` report, or the error it means: a drain that timed out
    (504), a freeze the gate no longer wanted (409)."""
    if report.get("drained") is False:
        raise _drain_timeout(report, report.get("in_flight", 0), {})
    if report.get("superseded"):
        paused = ("this instance paused the engines, but an instance's gate was resumed or repaused in "
                  "between: resume, or pause again, to bring every instance to one state"
                  if report.get("engines_paused") else "no engine was paused by this pause")
        err = PauseSuperseded("the gate was resumed or repaused in another mode between the wait pause's drain "
                              f"and its freeze: {paused}")
        err.details = report
        raise err
    return report


def lora_wait_response(report: dict[str, Any], instances: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """A per-adapter `wait` here and on every peer (each drains its own requests of that
    adapter; no engine pauses): a drain that timed out anywhere is the 504 it is here."""
    late = {peer: _in_flight(out) for peer, out in (instances or {}).items() if out.get("status") == 504}
    if report.get("drained") is False or late:
        merged = merge_instances(report, instances)[0] if instances else report
        raise _drain_timeout(merged, report.get("in_flight", 0) if report.get("drained") is False else 0, late)
    return report


def _drain_timeout(report: dict[str, Any], here: int, late: dict[str, Any]) -> DrainTimeout:
    left = ", ".join(f"{peer}: {n}" for peer, n in late.items())
    err = DrainTimeout(
        f"the wait pause did not drain: {here} turn(s) still in flight here"
        + (f", on peers {left}" if left else "")
        + " when the drain timed out. No engine was paused; the gate stays closed (no new turn starts; "
        "those in flight run on). Pause again (wait drains what is left, abort cuts it) or resume.")
    err.details = {**report, "ok": False, "drained": False, "engines_paused": False}
    return err


def _drained(out: dict[str, Any]) -> bool:
    report = out.get("report")
    return bool(out["ok"]) and isinstance(report, dict) and report.get("drained") is True


def _in_flight(out: dict[str, Any]) -> Any:
    report = out.get("report")
    return report.get("in_flight", "?") if isinstance(report, dict) else "no answer"


async def _both(relay: PeerRelay, path: str, body: bytes, authorization: str | None, timeout_s: float,
                local: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    peers = asyncio.ensure_future(relay.send("POST", path, body, authorization=authorization, timeout_s=timeout_s)) \
        if relay.peers else None
    try:
        report = await local
    finally:
        instances = await peers if peers is not None else {}
    return report, instances


async def wait_pause(control: ControlPlane, relay: PeerRelay, body: bytes, *,
                     authorization: str | None) -> tuple[dict[str, Any], int]:
    """A global `wait` pause here and on every peer (module doc): the report and 200 (207
    when a peer is down or an engine failed); `DrainTimeout` or `PauseSuperseded` else."""
    timeout_s = control.drain_timeout_s + relay.timeout_s  # a peer answers once its drain ends
    local, instances = await _both(relay, DRAIN_PATH, body, authorization, timeout_s,
                                   control.pause("wait", phase="drain"))
    late = {peer: _in_flight(out) for peer, out in instances.items()
            if not _drained(out) and not out.get("unreachable")}
    if not local["drained"] or late:
        merged, _ = merge_instances(local, instances)
        raise _drain_timeout(merged, local.get("in_flight", 0), late)
    drain_s = local["elapsed_s"]
    local, frozen = await _both(relay, FREEZE_PATH, body, authorization, relay.timeout_s,
                                control.pause("wait", phase="freeze"))
    superseded = [peer for peer, out in frozen.items() if out.get("status") == 409]
    if local.get("superseded") or superseded:
        merged, _ = merge_instances(local, frozen)
        phase_response({**merged, "superseded": True})
    local = {**local, "drain_s": drain_s}
    if not relay.peers:
        return local, 200 if local["ok"] else 207
    return merge_instances(local, frozen)
