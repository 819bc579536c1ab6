"""The session resource: create, read (summary and trajectory), probe, delete.

The turn routes of a session (`/sessions/{sid}/v1/...`) are the turn pipeline's; its
samples and reward are `samples.py`'s. Reading a session is using it: its TTL restarts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from trajectory import export, export_stream
from trajectory.codec.base import HistoryPolicy

from ...context import ServerContext
from ...errors import BadRequest, JournalUnavailable
from ...journal import durable
from ...journal_records import CREATE, create_body
from ...sessions import Session, SessionConfig
from ...turn.support_rules import resolve_k
from .. import samples as samples_api
from ..edge import route_doc
from ..models import SessionCreate, parse_json_model
from .common import JSON, OCTETS, ctx_of, json_response, read_body, read_use

__all__ = ["router", "session_view", "trajectory_response"]

router = APIRouter()


def turns_total(s: Session) -> int:
    """Every turn the session committed, on any branch, each once (a branch's inherited
    turns are its parent's): the live stream's `hello` carries it too, so a page tells a
    commit it missed while reconnecting."""
    return sum(b.trajectory.num_turns - b.fork_checkpoint for b in s.tree.branches())


def session_view(s: Session) -> dict[str, Any]:
    """Summary of a session: O(branches + turns) (small: no tokens, no messages)."""
    active = s.tree.active
    traj = active.trajectory
    return {
        "session_id": s.id,
        "state": s.state.value,
        "busy": s.inflight is not None,
        "home": s.home,
        "metadata": s.config.metadata,
        "history_policy": s.config.history_policy.value,
        "sampling_policy": s.config.sampling_policy,
        "sampling": s.config.sampling,
        "seed": s.config.seed,
        "active_branch": active.id,
        # the active branch's line (the turns a sample of it holds); `turns_total`: every
        # turn the session committed, on any branch, each once (a branch's inherited turns
        # are its parent's)
        "turns": len(traj.turns),
        "turns_total": turns_total(s),
        "tokens": len(traj),
        "sampled_tokens": sum(t.output_end - t.output_start for t in traj.turns),
        # every branch's tokens, each stored once (branches share their prefixes)
        "stored_tokens": s.tree.unique_tokens(),
        "branches": [
            {
                "id": b.id,
                "parent_id": b.parent_id,
                "fork_checkpoint": b.fork_checkpoint,
                "fork_index": b.fork_index,
                "reason": b.reason,
                "turns": len(b.trajectory.turns),
                "tokens": len(b.trajectory),
                # who asked for the branch's last turn (a harness's sub-agent or side request
                # usually opens a branch of its own): None when the client said nothing
                "lineage": _last_lineage(b),
            }
            for b in s.tree.branches()
        ],
        "agents": agents_view(s),
        "diagnostics": list(s.diagnostics),
        "diagnostics_dropped": s.diagnostics_dropped,
        "control": dataclasses.asdict(s.control_totals),
        "turns_discarded": s.turns_discarded,
        **samples_api.reward_view(s),
    }


def _last_lineage(b: Any) -> dict[str, Any] | None:
    turns = b.trajectory.turns
    lin = turns[-1].lineage if turns else None
    return None if lin is None else lin.to_dict()


def agents_view(s: Session) -> list[dict[str, Any]]:
    """Each (agent, kind, thread) that committed turns in the session, with its turn
    count and branches, in order of first commit: O(turns), each turn counted once (a
    fork's shared turns belong to the branch that committed them)."""
    seen: dict[tuple[str | None, str | None, str | None], dict[str, Any]] = {}
    for b in s.tree.branches():
        for t in b.trajectory.turns[b.fork_checkpoint:]:
            lin = t.lineage
            key = (None, None, None) if lin is None else (lin.agent, lin.kind, lin.thread)
            row = seen.get(key)
            if row is None:
                row = seen[key] = {"agent": key[0], "kind": key[1], "thread": key[2], "parent": None,
                                   "turns": 0, "branches": [], "first_seq": t.seq}
            if lin is not None and lin.parent is not None:
                row["parent"] = lin.parent
            row["turns"] += 1
            row["first_seq"] = min(row["first_seq"], t.seq)
            if b.id not in row["branches"]:
                row["branches"].append(b.id)
    rows = sorted(seen.values(), key=lambda r: r["first_seq"])
    for r in rows:
        del r["first_seq"]
    return rows


def _require_routed_shape(ctx: ServerContext) -> None:
    """A routing-replay session is refused at creation when its turns could not be
    stored: SGLang sends each row of routed experts flat, so splitting it needs the
    model's (layers, topk), from the settings or a model config.json the server could
    read (ServerContext.routed_shape). Without it every turn would do the engine work
    and then fail with a 502. vLLM's `.npy` payload carries its own shape, so a pool of
    vLLM engines alone needs nothing."""
    shape = ctx.routed_shape()
    if shape.layers or shape.topk:
        return
    protocols = ctx.registry.protocols()
    if protocols and protocols <= {"vllm"}:
        return
    raise BadRequest(
        "routing_replay: the model's routed-experts shape (MoE layers, experts per token) is unknown: no "
        "engine's model config.json (num_hidden_layers, num_experts_per_tok) could be read here, nor one "
        "beside the tokenizer. Start the server with --routed-experts-layers and --routed-experts-topk "
        "(env TITO_ROUTED_EXPERTS_LAYERS, TITO_ROUTED_EXPERTS_TOPK; settings routed_experts_layers, "
        "routed_experts_topk)")


def _export_metadata(s: Session) -> dict[str, Any]:
    return {"session_id": s.id, "metadata": s.config.metadata, "history_policy": s.config.history_policy.value}


async def trajectory_response(ctx: ServerContext, s: Session, fmt: str) -> Response:
    """The session's whole tree as JSON or npz (`trajectory.export`)."""
    if fmt not in ("json", "npz"):
        raise BadRequest("format must be 'json' or 'npz'")
    # JSON: `to_json_bytes` is a sequence of short orjson calls (`export_stream.iter_json`), so
    # the offload thread gives the GIL back to the loop between pieces; one orjson.dumps
    # of a 100K-token tree held it for ~10-25 ms in one call.
    build = export.to_npz_bytes if fmt == "npz" else export_stream.to_json_bytes
    async with s.lock:  # a commit must not mutate the branches while the offload thread reads them
        payload = await ctx.offload.run(build, s.tree, metadata=_export_metadata(s))
    return Response(content=payload, media_type=OCTETS if fmt == "npz" else JSON)


@router.post("/sessions", status_code=201, **route_doc(SessionCreate, 400, 413, 429, required=False))
async def create_session(request: Request) -> Response:
    ctx = ctx_of(request)
    body = await read_body(request, ctx.settings.max_body_bytes)
    spec: SessionCreate = await ctx.offload.run_sized(len(body), parse_json_model, body, SessionCreate)
    cfg = SessionConfig(
        ttl_s=spec.ttl_s or ctx.settings.default_ttl_s,
        metadata=spec.metadata,
        max_context_tokens=spec.max_context_tokens,
        sampling=spec.sampling.model_dump(exclude_none=True),
        lora=spec.lora,
        chat_template_kwargs=spec.chat_template_kwargs,
        history_policy=HistoryPolicy(spec.history_policy),
        routing_replay=ctx.settings.routing_replay if spec.routing_replay is None else spec.routing_replay,
        max_weight_lag=spec.max_weight_lag,
        sampling_policy=spec.sampling_policy or ctx.settings.sampling_policy,
        seed=spec.seed,
        sampling_support=resolve_k(spec.sampling_support, spec.sampling.model_dump(exclude_none=True)),
    )
    if cfg.routing_replay:
        _require_routed_shape(ctx)
    if ctx.journal is not None:
        ctx.journal.check_writable()
    s = ctx.store.create(cfg)
    if ctx.journal is not None:  # durable before its id is given out; unstored, it never existed
        try:
            await durable(ctx.journal.append(s.id, CREATE, create_body(s)))
        except JournalUnavailable:
            ctx.store.discard(s)
            raise
    base = str(request.base_url).rstrip("/")
    return json_response({"session_id": s.id, "base_url": f"{base}/sessions/{s.id}/v1", "api_key": s.token}, 201)


@router.get("/sessions/{sid}", **route_doc(None, 404))
async def get_session(sid: str, request: Request) -> Response:
    s = ctx_of(request).store.get(sid)
    read_use(request, s)  # reading a session is using it: its TTL restarts
    return json_response(session_view(s))


@router.head("/sessions/{sid}", include_in_schema=False)
async def head_session(sid: str, request: Request) -> Response:
    """Whether the session exists: harnesses probe their base URL (Claude Code sends
    HEAD to it before its first request); 404 when it does not."""
    ctx_of(request).store.get(sid)
    return Response(status_code=200)


@router.get("/sessions/{sid}/trajectory", **route_doc(None, 400, 404, media=(JSON, OCTETS)))
async def get_trajectory(sid: str, request: Request, format: str = "json") -> Response:
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    read_use(request, s)
    return await trajectory_response(ctx, s, format)


@router.delete("/sessions/{sid}", **route_doc(None, 400, 404, ok={204: "deleted (no trajectory asked)"},
                                              media=(JSON, OCTETS)))
async def delete_session(sid: str, request: Request, return_trajectory: bool = False,
                         format: str = "json") -> Response:
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    resp = await trajectory_response(ctx, s, format) if return_trajectory else None
    ctx.store.close(sid)  # routing state goes with the removal (store.on_remove)
    if ctx.journal is not None:  # its tombstone is stored before the 204 says it is gone
        await durable(ctx.journal.barrier())
    return resp if resp is not None else Response(status_code=204)
