"""The control plane: pause, resume, the trainer's weight version, and its state.

Each change is applied here and on every peer instance (`cluster_rules.py`); the
control plane itself (control/plane.py) knows nothing of HTTP or of peers.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..cluster_rules import cluster_wide, pause_everywhere
from ..edge import route_doc
from ..models import PauseRequest, ResumeRequest, WeightVersion, parse_json_model
from .common import PARTIAL, ctx_of, json_response, read_body

__all__ = ["router"]

router = APIRouter()

_CONTROL_BODY_LIMIT = 4096  # a control body is a few fields


@router.post("/control/pause", **route_doc(PauseRequest, 400, 409, 413, 504, required=False, ok=PARTIAL))
async def pause(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_body(request, _CONTROL_BODY_LIMIT)
    spec: PauseRequest = await ctx.offload.run(parse_json_model, body, PauseRequest)
    return await pause_everywhere(request, ctx, body, spec)


@router.post("/control/resume", **route_doc(ResumeRequest, 400, 413, required=False, ok=PARTIAL))
async def resume(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_body(request, _CONTROL_BODY_LIMIT)
    spec: ResumeRequest = await ctx.offload.run(parse_json_model, body, ResumeRequest)
    return await cluster_wide(request, body, ctx.control.resume(spec.lora))


@router.get("/control/state", **route_doc(None))
async def control_state(request: Request) -> Response:
    return json_response(ctx_of(request).control.state())


@router.post("/control/weight_version", **route_doc(WeightVersion, 400, 413, ok=PARTIAL))
async def weight_version(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_body(request, _CONTROL_BODY_LIMIT)
    spec: WeightVersion = await ctx.offload.run(parse_json_model, body, WeightVersion)
    out = ctx.control.set_weight_version(spec.version, force=spec.force)  # a 400 here is relayed nowhere
    return await cluster_wide(request, body, ctx.control.push_weight_version(out))
