"""Training samples and rewards: one session's, and a batch over any instances' sessions.

The work is `api/samples.py`'s (what a session contributes, streaming a batch) and
`api/samples_cluster.py`'s (gathering a batch's other instances' sessions); these
routes read the request and say whether this instance gathers (`cluster_rules.py`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from trajectory.lineage import AgentFilter

from .. import samples as samples_api
from ..cluster_rules import gathering_relay
from ..edge import route_doc
from ..models import AgentKind, RewardRequest, SampleFormat, SamplesBatch, parse_json_model
from .common import JSON, OCTETS, ctx_of, json_response, read_body, read_use

__all__ = ["router"]

router = APIRouter()


@router.get("/sessions/{sid}/samples", **route_doc(None, 400, 404, media=(JSON, OCTETS)))
async def get_samples(
    sid: str,
    request: Request,
    format: SampleFormat = "json",
    picker: str = samples_api.DEFAULT_PICKER,
    max_seq_len: Annotated[int | None, Query(ge=1)] = None,
    agent: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    agent_kind: AgentKind | None = None,
) -> Response:
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    read_use(request, s)
    return await samples_api.session_response(ctx, s, format, picker, max_seq_len, AgentFilter(agent, agent_kind))


@router.post("/sessions/{sid}/reward", **route_doc(RewardRequest, 400, 404, 413))
async def post_reward(sid: str, request: Request) -> Response:
    ctx = ctx_of(request)
    ctx.store.get(sid)  # 404 before reading a body for an unknown session
    body = await read_body(request, ctx.settings.max_body_bytes)
    spec: RewardRequest = await ctx.offload.run_sized(len(body), parse_json_model, body, RewardRequest)
    s = ctx.store.get(sid)
    ctx.store.touch(s)
    return json_response(await samples_api.set_reward(ctx, s, spec))


@router.post("/samples", **route_doc(SamplesBatch, 400, 404, 409, 413, 421, 503, media=(JSON, OCTETS)))
async def post_samples(request: Request, check: bool = False) -> Response:
    """A batch of any instances' sessions; relayed (a peer gathering a batch), only
    this instance's, and `check` validates without reading (samples_cluster.py)."""
    ctx = ctx_of(request)
    body = await read_body(request, ctx.settings.max_body_bytes)
    spec: SamplesBatch = await ctx.offload.run_sized(len(body), parse_json_model, body, SamplesBatch)
    gather = gathering_relay(request)
    authorization = request.headers.get("authorization")
    if check:
        return json_response(await samples_api.check_batch(ctx, spec, gather, authorization))
    return await samples_api.batch_response(ctx, spec, gather, authorization)
