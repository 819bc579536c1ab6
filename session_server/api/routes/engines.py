"""The engine pool, changed at runtime: list, add, remove (by this instance's id or by URL).

Every change is applied here and relayed to the peers (`cluster_rules.py`). Engine ids
are per instance, so a removal reaches the peers by the engine's URL; both removal
routes share one implementation (`_remove`). The engine routes note each URL they are
asked to add or remove, found or not: a joining instance's older read of its peers
must not undo it (control/peer_sync.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...context import ServerContext
from ...control.fanout import push_version
from ...errors import EngineError, NotFound, shown
from ..cluster_rules import added_everywhere, removed_everywhere
from ..edge import route_doc
from ..models import EngineAdd, parse_json_model
from .common import PARTIAL, ctx_of, json_response, read_body

__all__ = ["router"]

router = APIRouter()


@router.get("/engines", **route_doc(None))
async def list_engines(request: Request) -> Response:
    return json_response(ctx_of(request).registry.view())


async def _push_version_to(ctx: ServerContext, engine_id: str) -> dict[str, Any] | None:
    """A new engine learns the trainer's version (None: none set yet)."""
    version = ctx.control.weight_version
    if version is None:
        return None
    try:
        return {"ok": True, **await push_version(ctx.registry.adapter(engine_id), str(version))}
    except EngineError as exc:  # reported, not fatal: its tokens get the version at dispatch
        return {"ok": False, "error": str(exc)}


@router.post("/engines", status_code=201, **route_doc(
    EngineAdd, 400, 413, 502, ok={200: "the engine was already there (idempotent)", **PARTIAL}))
async def add_engine(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_body(request, 64 * 1024)
    spec: EngineAdd = await ctx.offload.run(parse_json_model, body, EngineAdd)
    ctx.registry.note(spec.url, "added")  # newer than a joining instance's read of its peers
    eng = ctx.registry.find(spec.url)
    existing = eng is not None
    if eng is None:
        eng = await ctx.registry.add(spec.url, dp_size=spec.dp_size)
    out = {"id": eng.id, "healthy": eng.healthy, "dp_size": eng.dp_size, "existing": existing}
    status = 200 if existing else 201
    if not existing:  # it reports the trainer's version from its first turn on
        push = out["weight_version_push"] = await _push_version_to(ctx, eng.id)
        if push is not None and not push["ok"]:  # added, but not told the version: partial
            out["ok"], status = False, 207
    return await added_everywhere(request, body, out, status)


async def _remove(request: Request, ctx: ServerContext, base_url: str, engine_id: str | None,
                  report: dict[str, Any]) -> Response:
    """Remove the engine at `base_url` here (`engine_id`: its id here; None: this
    instance has none there) and on every peer."""
    ctx.registry.note(base_url, "removed")  # even when absent: a joining instance must not add it
    if engine_id is not None:
        # turns already on it finish (their generation is good); new ones are refused;
        # the close runs in the background so DELETE does not wait for them
        ctx.registry.remove(engine_id, drain_s=ctx.settings.turn_timeout_s)
    return await removed_everywhere(request, base_url, engine_id is not None, report)


@router.delete("/engines/{engine_id}", status_code=204, **route_doc(None, 404, ok=PARTIAL))
async def remove_engine(engine_id: str, request: Request, base_url: str | None = None) -> Response:
    """`base_url` (a relayed removal): the engine with that URL, whatever its id here."""
    # Peers relay a removal as `DELETE /engines?url=` (cluster_rules.removal_path); an
    # instance of an older release sends `/engines/by-url?base_url=URL` (or its own id
    # in place of `by-url`), answered here so a cluster upgrades one instance at a time.
    ctx = ctx_of(request)
    if base_url is not None:
        ctx.registry.note(base_url, "removed")  # even when absent: a joining instance must not add it
        found = ctx.registry.find(base_url)
        if found is None:
            raise NotFound(f"no engine at {base_url!r}")
        engine_id = found.id
    if engine_id not in ctx.pool.engines:
        raise NotFound(f"unknown engine {shown(engine_id)}")
    url = ctx.registry.adapter(engine_id).base_url
    return await _remove(request, ctx, url, engine_id, {"removed": engine_id, "base_url": url})


@router.delete("/engines", status_code=204, **route_doc(None, 400, 404, ok=PARTIAL))
async def remove_engine_by_url(request: Request, url: str) -> Response:
    """The engine at `url` (`protocol=` prefix optional), here and on every peer: the
    form to use behind a proxy, where engine ids are per instance. 404 only when no
    instance had it."""
    ctx = ctx_of(request)
    base_url = ctx.registry.base_url_of(url)
    found = ctx.registry.find(base_url)
    return await _remove(request, ctx, base_url, found.id if found is not None else None,
                         {"removed_here": found is not None, "base_url": base_url})
