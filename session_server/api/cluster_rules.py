"""What a control request does in a cluster: which requests this instance relays to its
peers, and how their answers combine with its own (control/relay.py carries them).

A request a client sent is applied here and relayed to every peer; a relayed one
(`x-tito-relayed`) is applied here only. The combined answer is 200 when every
instance acknowledged, else 207 with each peer's outcome (`merge_instances`). These
rules are the routes' only cluster decisions: the routes do the local work and hand
their report here. Which instance owns a session (421 `wrong_instance`) is the session
store's rule (sessions.py); gathering a samples batch over owners is samples_cluster.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response

from ..context import ServerContext
from ..control import cluster_pause
from ..control.relay import RELAYED_HEADER, PeerRelay, merge_instances
from ..errors import NotFound
from .models import PauseRequest
from .routes.common import json_response, relay_of

__all__ = ["added_everywhere", "cluster_wide", "gathering_relay", "pause_everywhere", "relay_to_peers",
           "removal_path", "removed_everywhere"]


def relay_to_peers(request: Request, body: bytes, *, path: str | None = None,
                   absent_ok: bool = False) -> asyncio.Future[dict[str, dict[str, Any]]] | None:
    """Start relaying this control request to the peer instances; None when there are
    none or the request is itself a relay."""
    relay = relay_of(request)
    if not relay.wanted(request.headers):
        return None
    return asyncio.ensure_future(relay.send(
        request.method, path or request.url.path, body,
        authorization=request.headers.get("authorization"), absent_ok=absent_ok))


def gathering_relay(request: Request) -> PeerRelay | None:
    """The relay a `POST /samples` gathers its other instances' sessions with: a
    client's batch; None for a peer's part of one (it serves only its own sessions)."""
    relay = relay_of(request)
    return relay if relay.wanted(request.headers) else None


async def cluster_wide(request: Request, body: bytes, local: Coroutine[Any, Any, dict[str, Any]]) -> Response:
    """Apply `local` here and on every peer at once; answer when all have (a pause
    returns only once every instance paused): 200 when all acknowledged, else 207."""
    peers = relay_to_peers(request, body)
    try:
        report = await local
    finally:
        instances = await peers if peers is not None else None
    if instances is None:
        return json_response(report, 200 if report["ok"] else 207)
    return json_response(*merge_instances(report, instances))


async def _lora_wait(request: Request, body: bytes, local: Coroutine[Any, Any, dict[str, Any]]) -> Response:
    """A per-adapter wait pause here and on every peer: 504 when any instance's drain
    timed out (peers are asked either way), else as `cluster_wide`."""
    peers = relay_to_peers(request, body)
    try:
        report = await local
    finally:
        instances = await peers if peers is not None else None
    report = cluster_pause.lora_wait_response(report, instances)
    if instances is None:
        return json_response(report, 200 if report["ok"] else 207)
    return json_response(*merge_instances(report, instances))


async def pause_everywhere(request: Request, ctx: ServerContext, body: bytes, spec: PauseRequest) -> Response:
    """`POST /control/pause` over the cluster. `abort` and `keep` pause every instance
    at once; a per-adapter `wait` drains each instance's own requests of that adapter
    (no engine pauses); the whole `wait` pause runs in two phases over the instances
    (control/cluster_pause.py), and a relayed request names its phase (`?phase=`)."""
    if spec.mode != "wait":
        return await cluster_wide(request, body, ctx.control.pause(spec.mode, spec.lora))
    if spec.lora is not None:  # each instance drains its own requests of that adapter; no engine pauses
        return await _lora_wait(request, body, ctx.control.pause("wait", spec.lora))
    if request.headers.get(RELAYED_HEADER) is None:  # the whole wait pause, here and on every peer
        report, status = await cluster_pause.wait_pause(
            ctx.control, relay_of(request), body, authorization=request.headers.get("authorization"))
        return json_response(report, status)
    # one phase of a peer's wait pause (control/cluster_pause.py); a relay without a phase: all of it here
    phase = request.query_params.get("phase")
    report = cluster_pause.phase_response(await ctx.control.pause("wait", phase=phase))
    return json_response(report, 200 if report["ok"] else 207)


async def added_everywhere(request: Request, body: bytes, out: dict[str, Any], status: int) -> Response:
    """`POST /engines` once added here (`out`, `status`): the same body on every peer,
    where an engine already there is success (200, idempotent by URL)."""
    peers = relay_to_peers(request, body)
    if peers is None:
        return json_response(out, status)
    merged, code = merge_instances(out, await peers)
    return json_response(merged, status if code == 200 else code)


def removal_path(base_url: str) -> str:
    """How an engine removal reaches a peer: by the engine's URL (`DELETE /engines?url=`),
    since engine ids are per instance. Instances of an older release sent
    `DELETE /engines/by-url?base_url=URL` instead; the engines routes still take that."""
    return f"/engines?url={quote(base_url, safe='')}"


async def removed_everywhere(request: Request, base_url: str, removed_here: bool, report: dict[str, Any]) -> Response:
    """An engine removal done here (`removed_here`: this instance had it), relayed to
    every peer by URL, where an absent engine counts as removed: a bare 204 when every
    instance acknowledged, 404 only when none had it, else 207 with `report`."""
    peers = relay_to_peers(request, b"", path=removal_path(base_url), absent_ok=True)
    instances = await peers if peers is not None else {}
    if not removed_here and all(out.get("absent") for out in instances.values() if out["ok"]) \
            and all(out["ok"] for out in instances.values()):
        raise NotFound(f"no instance has an engine at {base_url!r}")
    if peers is None:
        return Response(status_code=204)
    merged, code = merge_instances({"ok": True, **report}, instances)
    return Response(status_code=204) if code == 200 else json_response(merged, code)
