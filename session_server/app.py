"""App factory: routes, the lifespan (`lifecycle.py` builds and stops what they share), and the one error map.

Handlers read raw bytes and hand parsing/serialization to the CPU offload threads, so the
event loop only moves bytes; `/health` answers without touching any session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Annotated, Any
from urllib.parse import quote

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

from trajectory import export
from trajectory.codec.base import HistoryPolicy
from trajectory.errors import CodecError

from .api import samples as samples_api
from .api.dialects import OPENAI_RESPONSES
from .api.dialects import anthropic_messages as anthropic
from .api.edge import ContainErrors, install_openapi, internal_error_body, route_doc
from .api.edge import read_body as _read_body
from .api.models import (
    ChatRequest,
    EngineAdd,
    PauseRequest,
    ResumeRequest,
    RewardRequest,
    SampleFormat,
    SamplesBatch,
    SessionCreate,
    WeightVersion,
    parse_json_model,
)
from .api.routes import turns as turn_routes
from .api.turn_endpoint import TurnEndpoint
from .auth import install_auth, new_instance_id
from .context import ServerContext, log
from .control import cluster_pause
from .control.fanout import push_version
from .control.peer_sync import sync_from_peers
from .control.relay import RELAYED_HEADER, PeerRelay, merge_instances
from .engines.admission_check import parse_engine_spec
from .errors import (
    BadRequest,
    ClientGone,
    EngineError,
    NotFound,
    ServiceError,
    from_http_status,
    from_library,
    shown,
)
from .lifecycle import AppConfig, build_context, shutdown, start_background
from .sessions import Session, SessionConfig

__all__ = ["AppConfig", "create_app", "session_view"]

JSON = "application/json"
OCTETS = "application/octet-stream"
PARTIAL = {207: "some engines or peer instances failed; the report names them"}


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


def _json(body: Any, status: int = 200) -> Response:
    return Response(content=orjson.dumps(body), status_code=status, media_type=JSON)


def session_view(s: Session) -> dict[str, Any]:
    """Summary of a session: O(branches + turns of the active branch) (small)."""
    active = s.tree.active
    traj = active.trajectory
    return {
        "session_id": s.id,
        "state": s.state.value,
        "busy": s.inflight is not None,
        "home": s.home,
        "metadata": s.config.metadata,
        "history_policy": s.config.history_policy.value,
        "active_branch": active.id,
        "turns": len(traj.turns),
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
            }
            for b in s.tree.branches()
        ],
        "diagnostics": list(s.diagnostics),
        "diagnostics_dropped": s.diagnostics_dropped,
        "control": dataclasses.asdict(s.control_totals),
        "turns_discarded": s.turns_discarded,
        **samples_api.reward_view(s),
    }


async def _join_cluster(relay: PeerRelay, ctx: ServerContext) -> None:
    """The peer sync of a starting instance, logged; its gate opens whatever happens."""
    try:
        outcome = await sync_from_peers(relay, ctx.control, ctx.registry, drain_s=ctx.settings.turn_timeout_s)
    except Exception:  # its `finally` opened the gate: serve as a lone instance would
        log.exception("peer sync failed; serving with this instance's own state")
        return
    if outcome.adopted_from:
        log.info("joined the cluster: %s", orjson.dumps(outcome.as_dict()).decode())
    else:
        log.info("no peer answered: serving with this instance's own state")


def create_app(config: AppConfig) -> FastAPI:
    if config.settings.instance_id is None:  # one identity per app: /health and the session-id prefix
        config = dataclasses.replace(
            config, settings=config.settings.model_copy(update={"instance_id": new_instance_id()}))
    settings = config.settings
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = await build_context(config)
        state["ctx"] = app.state.ctx = ctx
        app.state.turns = turns = TurnEndpoint(ctx)  # the turn routes' entry point (api/routes/turns.py)
        app.state.runner = turns.runner
        state["relay"] = relay = PeerRelay(settings.peers, timeout_s=settings.peer_timeout_s,
                                           admin_token=settings.admin_token)
        background = start_background(ctx)
        if settings.peers:  # join the cluster's state before serving turns (control/peer_sync.py)
            ctx.control.begin_sync()
            background.tasks.append(asyncio.create_task(_join_cluster(relay, ctx), name="tito-peer-sync"))
        try:
            yield
        finally:
            await shutdown(ctx, background)
            await relay.aclose()

    def count_internal() -> None:
        if "ctx" in state:
            state["ctx"].metrics.errors_total.labels(type="internal_error").inc()

    app = FastAPI(
        title="TITO session server",
        summary="Token-in, token-out sessions for multi-turn agentic RL rollouts",
        lifespan=lifespan,
        middleware=[Middleware(ContainErrors, on_error=count_internal)],
    )
    install_openapi(
        app,
        [SessionCreate, ChatRequest, anthropic.MessagesRequest, anthropic.CountTokensRequest, OPENAI_RESPONSES.request_model,
         PauseRequest, ResumeRequest, WeightVersion, EngineAdd, RewardRequest, SamplesBatch],
    )
    model_name = _served_model_name(config.tokenizer)
    install_auth(app, settings.admin_token)

    def ctx_of() -> ServerContext:
        return state["ctx"]

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        if "ctx" in state:
            state["ctx"].metrics.errors_total.labels(type=exc.type).inc()
        if isinstance(exc, ClientGone):  # nobody is left to read a response
            log.info("%s %s: %s", request.method, request.url.path, exc.message)
        elif exc.status >= 500:
            log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status, exc.type, exc.message)
        # the one place an error takes its route's dialect shape (Anthropic's on its routes)
        body = anthropic.error_body(exc) if anthropic.owns_path(request.url.path) else exc.to_body()
        resp = _json(body, exc.status)
        if exc.retry_after_s is not None:
            resp.headers["retry-after"] = str(exc.retry_after_s)
        if exc.should_retry is not None:
            resp.headers["x-should-retry"] = "true" if exc.should_retry else "false"
        return resp

    @app.exception_handler(CodecError)
    async def _codec_error(request: Request, exc: CodecError) -> Response:
        return await _service_error(request, from_library(exc) or BadRequest(str(exc)))

    @app.exception_handler(RequestValidationError)
    async def _framework_validation(request: Request, exc: RequestValidationError) -> Response:
        errs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
        return await _service_error(request, BadRequest(f"invalid request: {errs}"))

    @app.exception_handler(StarletteHTTPException)
    async def _framework_http(request: Request, exc: StarletteHTTPException) -> Response:
        resp = await _service_error(request, from_http_status(exc.status_code, str(exc.detail)))
        resp.headers.update(exc.headers or {})  # e.g. Allow on a 405
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # Reached only by errors outside ContainErrors (another middleware): Starlette
        # re-raises after this response and uvicorn closes the socket, so say so.
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        count_internal()
        return Response(internal_error_body(exc), 500, {"connection": "close"}, media_type=JSON)

    health_body = orjson.dumps({"status": "ok", "instance_id": settings.instance_id})
    syncing_body = orjson.dumps({"status": "syncing", "instance_id": settings.instance_id,
                                 "detail": "reading the cluster's control state from its peers"})

    @app.get("/health")
    async def health() -> Response:
        if not state["ctx"].control.synced:  # a proxy sends nothing here until it has joined
            return Response(content=syncing_body, status_code=503, media_type=JSON)
        return Response(content=health_body, media_type=JSON)

    @app.get("/metrics", **route_doc(None, media=("text/plain",)))
    async def metrics() -> Response:
        ctx = ctx_of()
        ctx.metrics.sessions_active.set(len(ctx.store))
        return Response(content=ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/sessions", status_code=201, **route_doc(SessionCreate, 400, 413, 429, required=False))
    async def create_session(request: Request) -> Response:
        ctx = ctx_of()
        body = await _read_body(request, ctx.settings.max_body_bytes)
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
        )
        if cfg.routing_replay:
            _require_routed_shape(ctx)
        s = ctx.store.create(cfg)
        base = str(request.base_url).rstrip("/")
        return _json({"session_id": s.id, "base_url": f"{base}/sessions/{s.id}/v1", "api_key": s.token}, 201)

    app.include_router(turn_routes.router)  # the turn routes: api/routes/turns.py

    @app.get("/sessions/{sid}/v1/responses/{response_id}", **route_doc(None, 404))
    async def get_response(sid: str, response_id: str) -> Response:
        store = ctx_of().store
        s = store.get(sid)
        store.touch(s)
        return Response(content=OPENAI_RESPONSES.stored_body(s, response_id), media_type=JSON)

    @app.get("/sessions/{sid}", **route_doc(None, 404))
    async def get_session(sid: str) -> Response:
        store = ctx_of().store
        s = store.get(sid)
        store.touch(s)  # reading a session is using it: its TTL restarts (issue 16.10)
        return _json(session_view(s))

    @app.head("/sessions/{sid}", include_in_schema=False)
    async def head_session(sid: str) -> Response:
        """Whether the session exists: harnesses probe their base URL (Claude Code sends
        HEAD to it before its first request); 404 when it does not."""
        ctx_of().store.get(sid)
        return Response(status_code=200)

    @app.get("/sessions/{sid}/trajectory", **route_doc(None, 400, 404, media=(JSON, "application/octet-stream")))
    async def get_trajectory(sid: str, format: str = "json") -> Response:
        ctx = ctx_of()
        s = ctx.store.get(sid)
        ctx.store.touch(s)
        return await _trajectory_response(ctx, s, format)

    @app.get("/sessions/{sid}/samples", **route_doc(None, 400, 404, media=(JSON, OCTETS)))
    async def get_samples(
        sid: str,
        format: SampleFormat = "json",
        picker: str = samples_api.DEFAULT_PICKER,
        max_seq_len: Annotated[int | None, Query(ge=1)] = None,
    ) -> Response:
        ctx = ctx_of()
        s = ctx.store.get(sid)
        ctx.store.touch(s)
        return await samples_api.session_response(ctx, s, format, picker, max_seq_len)

    @app.post("/sessions/{sid}/reward", **route_doc(RewardRequest, 400, 404, 413))
    async def post_reward(sid: str, request: Request) -> Response:
        ctx = ctx_of()
        ctx.store.get(sid)  # 404 before reading a body for an unknown session
        body = await _read_body(request, ctx.settings.max_body_bytes)
        spec: RewardRequest = await ctx.offload.run_sized(len(body), parse_json_model, body, RewardRequest)
        s = ctx.store.get(sid)
        ctx.store.touch(s)
        return _json(await samples_api.set_reward(ctx, s, spec))

    @app.post("/samples", **route_doc(SamplesBatch, 400, 404, 409, 413, 421, 503, media=(JSON, OCTETS)))
    async def post_samples(request: Request, check: bool = False) -> Response:
        """A batch of any instances' sessions; relayed (a peer gathering a batch), only
        this instance's, and `check` validates without reading (samples_cluster.py)."""
        ctx = ctx_of()
        body = await _read_body(request, ctx.settings.max_body_bytes)
        spec: SamplesBatch = await ctx.offload.run_sized(len(body), parse_json_model, body, SamplesBatch)
        relay: PeerRelay = state["relay"]
        gather = relay if relay.wanted(request.headers) else None  # a client's batch, not a peer's part of one
        authorization = request.headers.get("authorization")
        if check:
            return _json(await samples_api.check_batch(ctx, spec, gather, authorization))
        return await samples_api.batch_response(ctx, spec, gather, authorization)

    @app.delete(
        "/sessions/{sid}",
        **route_doc(None, 400, 404, ok={204: "deleted (no trajectory asked)"}, media=(JSON, "application/octet-stream")),
    )
    async def delete_session(sid: str, return_trajectory: bool = False, format: str = "json") -> Response:
        ctx = ctx_of()
        s = ctx.store.get(sid)
        resp = await _trajectory_response(ctx, s, format) if return_trajectory else None
        ctx.store.close(sid)  # routing state goes with the removal (store.on_remove)
        return resp if resp is not None else Response(status_code=204)

    def relay_to_peers(request: Request, body: bytes, *, path: str | None = None,
                       absent_ok: bool = False) -> asyncio.Future[dict[str, dict[str, Any]]] | None:
        """Start relaying this control request to the peer instances (issue 14.3); None
        when there are none or the request is itself a relay (control/relay.py)."""
        relay: PeerRelay = state["relay"]
        if not relay.wanted(request.headers):
            return None
        return asyncio.ensure_future(relay.send(
            request.method, path or request.url.path, body,
            authorization=request.headers.get("authorization"), absent_ok=absent_ok))

    async def cluster_wide(request: Request, body: bytes, local: Coroutine[Any, Any, dict[str, Any]]) -> Response:
        """Apply `local` here and on every peer at once; answer when all have (a pause
        returns only once every instance paused): 200 when all acknowledged, else 207."""
        peers = relay_to_peers(request, body)
        try:
            report = await local
        finally:
            instances = await peers if peers is not None else None
        if instances is None:
            return _json(report, 200 if report["ok"] else 207)
        return _json(*merge_instances(report, instances))

    async def lora_wait(request: Request, body: bytes, local: Coroutine[Any, Any, dict[str, Any]]) -> Response:
        """A per-adapter wait pause here and on every peer: 504 when any instance's drain
        timed out (peers are asked either way), else as `cluster_wide`."""
        peers = relay_to_peers(request, body)
        try:
            report = await local
        finally:
            instances = await peers if peers is not None else None
        report = cluster_pause.lora_wait_response(report, instances)
        if instances is None:
            return _json(report, 200 if report["ok"] else 207)
        return _json(*merge_instances(report, instances))

    @app.post("/control/pause", **route_doc(PauseRequest, 400, 409, 413, 504, required=False, ok=PARTIAL))
    async def pause(request: Request) -> Response:
        ctx = ctx_of()
        body = await _read_body(request, 4096)
        spec: PauseRequest = await ctx.offload.run(parse_json_model, body, PauseRequest)
        if spec.mode != "wait":
            return await cluster_wide(request, body, ctx.control.pause(spec.mode, spec.lora))
        if spec.lora is not None:  # each instance drains its own requests of that adapter; no engine pauses
            return await lora_wait(request, body, ctx.control.pause("wait", spec.lora))
        if request.headers.get(RELAYED_HEADER) is None:  # the whole wait pause, here and on every peer
            report, status = await cluster_pause.wait_pause(
                ctx.control, state["relay"], body, authorization=request.headers.get("authorization"))
            return _json(report, status)
        # one phase of a peer's wait pause (control/cluster_pause.py); a relay without a phase: all of it here
        phase = request.query_params.get("phase")
        report = cluster_pause.phase_response(await ctx.control.pause("wait", phase=phase))
        return _json(report, 200 if report["ok"] else 207)

    @app.post("/control/resume", **route_doc(ResumeRequest, 400, 413, required=False, ok=PARTIAL))
    async def resume(request: Request) -> Response:
        ctx = ctx_of()
        body = await _read_body(request, 4096)
        spec: ResumeRequest = await ctx.offload.run(parse_json_model, body, ResumeRequest)
        return await cluster_wide(request, body, ctx.control.resume(spec.lora))

    @app.get("/control/state", **route_doc(None))
    async def control_state() -> Response:
        return _json(ctx_of().control.state())

    @app.post("/control/weight_version", **route_doc(WeightVersion, 400, 413, ok=PARTIAL))
    async def weight_version(request: Request) -> Response:
        ctx = ctx_of()
        body = await _read_body(request, 4096)
        spec: WeightVersion = await ctx.offload.run(parse_json_model, body, WeightVersion)
        out = ctx.control.set_weight_version(spec.version, force=spec.force)  # a 400 here is relayed nowhere
        return await cluster_wide(request, body, ctx.control.push_weight_version(out))

    @app.get("/engines", **route_doc(None))
    async def list_engines() -> Response:
        return _json(ctx_of().registry.view())

    async def _push_version_to(ctx: ServerContext, engine_id: str) -> dict[str, Any] | None:
        """A new engine learns the trainer's version (None: none set yet)."""
        version = ctx.control.weight_version
        if version is None:
            return None
        try:
            return {"ok": True, **await push_version(ctx.registry.adapter(engine_id), str(version))}
        except EngineError as exc:  # reported, not fatal: its tokens get the version at dispatch
            return {"ok": False, "error": str(exc)}

    @app.post("/engines", status_code=201, **route_doc(
        EngineAdd, 400, 413, 502, ok={200: "the engine was already there (idempotent)", **PARTIAL}))
    async def add_engine(request: Request) -> Response:
        ctx = ctx_of()
        body = await _read_body(request, 64 * 1024)
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
        peers = relay_to_peers(request, body)
        if peers is None:
            return _json(out, status)
        merged, code = merge_instances(out, await peers)
        return _json(merged, status if code == 200 else code)

    @app.delete("/engines/{engine_id}", status_code=204, **route_doc(None, 404, ok=PARTIAL))
    async def remove_engine(engine_id: str, request: Request, base_url: str | None = None) -> Response:
        """`base_url` (a relayed removal): the engine with that URL, whatever its id here."""
        ctx = ctx_of()
        if base_url is not None:
            ctx.registry.note(base_url, "removed")  # even when absent: a joining instance must not add it
            found = ctx.registry.find(base_url)
            if found is None:
                raise NotFound(f"no engine at {base_url!r}")
            engine_id = found.id
        url = ctx.registry.adapter(engine_id).base_url if engine_id in ctx.engines.engines else None
        if url is not None:
            ctx.registry.note(url, "removed")
        # turns already on it finish (their generation is good); new ones are refused;
        # the close runs in the background so DELETE does not wait for them
        if url is None or ctx.registry.remove(engine_id, drain_s=ctx.settings.turn_timeout_s) is None:
            raise NotFound(f"unknown engine {shown(engine_id)}")
        peers = relay_to_peers(request, b"", path=f"/engines/{engine_id}?base_url={quote(url, safe='')}",
                               absent_ok=True)
        if peers is None:
            return Response(status_code=204)
        merged, code = merge_instances({"ok": True, "removed": engine_id, "base_url": url}, await peers)
        return Response(status_code=204) if code == 200 else _json(merged, code)

    @app.delete("/engines", status_code=204, **route_doc(None, 400, 404, ok=PARTIAL))
    async def remove_engine_by_url(request: Request, url: str) -> Response:
        """The engine at `url` (`protocol=` prefix optional), here and on every peer: the
        form to use behind a proxy, where engine ids are per instance. 404 only when no
        instance had it."""
        ctx = ctx_of()
        try:
            base_url = parse_engine_spec(url)[1]
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        if not base_url:
            raise BadRequest("url must name an engine, e.g. http://gpu-node:30000")
        ctx.registry.note(base_url, "removed")
        found = ctx.registry.find(base_url)
        if found is not None:
            ctx.registry.remove(found.id, drain_s=ctx.settings.turn_timeout_s)
        peers = relay_to_peers(request, b"", path=f"/engines/by-url?base_url={quote(base_url, safe='')}",
                               absent_ok=True)
        instances = await peers if peers is not None else {}
        if found is None and all(out.get("absent") for out in instances.values() if out["ok"]) \
                and all(out["ok"] for out in instances.values()):
            raise NotFound(f"no instance has an engine at {base_url!r}")
        if peers is None:
            return Response(status_code=204)
        merged, code = merge_instances({"ok": True, "removed_here": found is not None, "base_url": base_url},
                                       instances)
        return Response(status_code=204) if code == 200 else _json(merged, code)

    @app.get("/v1/models", **route_doc(None))
    async def list_models() -> Response:
        return _json(_model_list(model_name))

    @app.get("/sessions/{sid}/v1/models", **route_doc(None, 404))
    async def list_session_models(sid: str) -> Response:
        ctx_of().store.get(sid)
        return _json(_model_list(model_name))

    @app.get("/sessions/{sid}/v1/models/{model_id:path}", **route_doc(None, 404))
    async def get_session_model(sid: str, model_id: str) -> Response:
        ctx_of().store.get(sid)
        if model_id != model_name:
            raise NotFound(f"unknown model {model_id!r}; this server serves {model_name!r}")
        return _json(_model_card(model_name))

    return app


def _served_model_name(tokenizer: Any) -> str:
    """What `/v1/models` lists: the tokenizer's name or path, last component (the
    server serves exactly one model; any `model` a request names is echoed back)."""
    name = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "name_or_path", "")
    return str(name).rstrip("/").rsplit("/", 1)[-1] or "tito-session"


_STARTED = int(time.time())


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "tito-session-server"}


def _model_list(name: str) -> dict[str, Any]:
    """An OpenAI model list: many clients call it first (issue 16.5)."""
    return {"object": "list", "data": [_model_card(name)]}


def _export_metadata(s: Session) -> dict[str, Any]:
    return {"session_id": s.id, "metadata": s.config.metadata, "history_policy": s.config.history_policy.value}


async def _trajectory_response(ctx: ServerContext, s: Session, fmt: str) -> Response:
    if fmt not in ("json", "npz"):
        raise BadRequest("format must be 'json' or 'npz'")
    # JSON: `to_json_bytes` is a sequence of short orjson calls (`export.iter_json`), so
    # the offload thread gives the GIL back to the loop between pieces; one orjson.dumps
    # of a 100K-token tree held it for ~10-25 ms in one call (issue 8).
    build = export.to_npz_bytes if fmt == "npz" else export.to_json_bytes
    async with s.lock:  # a commit must not mutate the branches while the offload thread reads them
        payload = await ctx.offload.run(build, s.tree, metadata=_export_metadata(s))
    return Response(content=payload, media_type="application/octet-stream" if fmt == "npz" else JSON)
