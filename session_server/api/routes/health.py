"""`/health` and `/metrics`: what a proxy and Prometheus poll.

`/health` answers without touching any session; while a starting instance reads its
peers' control state (control/peer_sync.py) it is a 503, so a proxy sends nothing here
until the instance has joined the cluster; so it is while the journal replays
(`recovering`), and once the journal's writer process has died (`journal_down`: nothing
can be committed here until a restart replays the journal).
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..edge import route_doc
from .common import JSON, ctx_of

__all__ = ["router"]

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    ctx = ctx_of(request)
    instance_id = ctx.settings.instance_id
    if ctx.store.recovering:  # the journal replays: the sessions are not back yet
        body = {"status": "recovering", "instance_id": instance_id,
                "detail": "replaying the session journal"}
        return Response(content=orjson.dumps(body), status_code=503, media_type=JSON)
    if ctx.journal is not None and ctx.journal.dead is not None:  # nothing can be committed here until a restart
        body = {"status": "journal_down", "instance_id": instance_id,
                "detail": f"the session journal's writer died ({ctx.journal.dead}); restart this instance"}
        return Response(content=orjson.dumps(body), status_code=503, media_type=JSON)
    if not ctx.control.synced:  # a proxy sends nothing here until it has joined
        body = {"status": "syncing", "instance_id": instance_id,
                "detail": "reading the cluster's control state from its peers"}
        return Response(content=orjson.dumps(body), status_code=503, media_type=JSON)
    return Response(content=orjson.dumps({"status": "ok", "instance_id": instance_id}), media_type=JSON)


@router.get("/metrics", **route_doc(None, media=("text/plain",)))
async def metrics(request: Request) -> Response:
    ctx = ctx_of(request)
    ctx.metrics.sessions_active.set(len(ctx.store))
    return Response(content=ctx.metrics.render(), media_type="text/plain; version=0.0.4")
