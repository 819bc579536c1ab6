"""App factory: the assembler. It builds the app, registers the one error map
(`api/error_map.py`), auth and the routers (`api/routes/`), and runs the lifespan
(`lifecycle.py` builds, joins the cluster, and stops what the routes share).

The routes read what they share from `app.state` (`api/routes/common.py`); the turn
routes below read it through this factory's `state` until they move to their router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .api.dialects import (
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    OPENAI_RESPONSES,
    Dialect,
    Rendered,
    as_response,
    render,
)
from .api.dialects import anthropic_messages as anthropic
from .api.edge import install_openapi, route_doc
from .api.error_map import install_error_map
from .api.models import (
    ChatRequest,
    EngineAdd,
    PauseRequest,
    ResumeRequest,
    RewardRequest,
    SamplesBatch,
    SessionCreate,
    WeightVersion,
)
from .api.routes import control, engines, health, models, samples, sessions
from .api.routes.common import JSON
from .api.routes.common import client_gone as _client_gone
from .api.routes.common import json_response as _json
from .api.routes.common import read_body as _read_body
from .api.routes.sessions import session_view
from .auth import install_auth, new_instance_id
from .context import ServerContext, log
from .errors import CommittedUnanswered
from .lifecycle import (
    AppConfig,
    build_context,
    join_cluster,
    open_relay,
    shutdown,
    start_background,
)
from .turn.live import LiveTurn
from .turn.pipeline import TurnOutput, TurnRunner
from .turn.replay import Hold, ReplayLog, identify

__all__ = ["AppConfig", "create_app", "session_view"]


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
        state["runner"] = app.state.runner = TurnRunner(ctx)
        state["replays"] = app.state.replays = ReplayLog(
            ctx.metrics, per_session=settings.replay_per_session, max_bytes=settings.replay_store_bytes,
            grace_s=settings.replay_grace_s)
        ctx.store.on_remove.append(lambda s: state["replays"].forget(s.id))
        app.state.relay = relay = open_relay(settings)
        background = start_background(ctx)
        join_cluster(ctx, relay, background)  # with peers: their state before serving turns
        try:
            yield
        finally:
            await shutdown(ctx, background)
            await relay.aclose()

    app = FastAPI(
        title="TITO session server",
        summary="Token-in, token-out sessions for multi-turn agentic RL rollouts",
        lifespan=lifespan,
    )
    install_error_map(app)  # first: every middleware added later wraps its containment
    install_openapi(
        app,
        [SessionCreate, ChatRequest, anthropic.MessagesRequest, anthropic.CountTokensRequest, OPENAI_RESPONSES.request_model,
         PauseRequest, ResumeRequest, WeightVersion, EngineAdd, RewardRequest, SamplesBatch],
    )
    app.state.model_name = models.served_model_name(config.tokenizer)
    install_auth(app, settings.admin_token)
    _add_routes(app, health.router, sessions.router)

    def ctx_of() -> ServerContext:
        return state["ctx"]

    @app.post(
        "/sessions/{sid}/v1/chat/completions",
        **route_doc(OPENAI_CHAT.request_model, 400, 404, 409, 413, 429, 502, 503, 504, media=(JSON, "text/event-stream")),
    )
    async def chat(sid: str, request: Request) -> Response:
        return await dialect_turn(sid, request, OPENAI_CHAT)

    async def dialect_turn(
        sid: str, request: Request, dialect: Dialect, *, parse: Callable[[bytes], ChatRequest] | None = None,
        committed: Callable[[ChatRequest, TurnOutput], None] | None = None,
    ) -> Response:
        """One turn of any dialect's route: read the body, answer a replayed request
        from its original (`idempotency.py`), else run the turn and render it.
        `parse` replaces the dialect's (one bound to the session); `committed` runs
        once per committed turn (not for a replay), before the response is rendered."""
        ctx = ctx_of()
        session = ctx.store.get(sid)  # 404 before reading a body for an unknown session
        body = await _read_body(request, ctx.settings.max_body_bytes)
        # a retry replays only its own attempt: never a turn the client has since built on
        ident = await identify(ctx.offload, sid, dialect.name, request.headers, body, built_on=session.built_on)

        live = LiveTurn(ctx, dialect)

        async def produce(hold: Hold) -> Rendered:
            req, out = await state["runner"].run(sid, body, parse=parse or dialect.parse,
                                                 client_gone=hold(_client_gone(request)), live=live)
            # committed: from here on nothing may turn into a retry that samples the turn again
            try:
                if committed is not None:
                    committed(req, out)
                if live.active:  # streamed as sampled: the frames sent are the response
                    rendered = live.finish(out)
                else:
                    rendered = await render(ctx, dialect, req, out)
                return dataclasses.replace(rendered, turn=(out.branch_id, out.turn_index))
            except Exception as exc:
                log.exception("session %s: turn %d committed, its response failed", sid, out.turn_index)
                failed = CommittedUnanswered(
                    f"turn {out.turn_index} of session {sid} was committed, but its response could not be built "
                    f"({type(exc).__name__}); the turn is in GET /sessions/{sid}/trajectory, and a retry of this "
                    "request gets this same error, never a second turn")
                failed.turn = (out.branch_id, out.turn_index)
                raise failed from exc

        # a streamed turn answers once it starts, or once it has waited
        # keepalive_s without starting (queued for the session: live.py), then sends
        # keep-alives; anything before that (and a turn that is not streamed) answers as
        # one response, errors as HTTP errors
        followed: asyncio.Future[LiveTurn] = asyncio.get_running_loop().create_future()

        def follow(original: LiveTurn) -> None:
            if not followed.done():
                followed.set_result(original)

        task = asyncio.ensure_future(state["replays"].serve(ident, produce, live=live, on_follow=follow))
        task.add_done_callback(live.on_done)
        opened = asyncio.ensure_future(live.opened.wait())
        try:
            await asyncio.wait([task, opened, followed], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            opened.cancel()
        if followed.done() and not task.done():  # a replay of a turn streaming now: follow it live
            return StreamingResponse(followed.result().follow(task), media_type="text/event-stream")
        followed.cancel()
        if not live.opened.is_set():
            return as_response(await task)
        return StreamingResponse(live.stream(task, held=ident.recorded), media_type="text/event-stream")

    @app.post(
        "/sessions/{sid}/v1/messages",
        **route_doc(ANTHROPIC_MESSAGES.request_model, 400, 404, 409, 413, 429, 502, 503, 504,
                    media=(JSON, "text/event-stream")),
    )
    async def messages(sid: str, request: Request) -> Response:
        return await dialect_turn(sid, request, ANTHROPIC_MESSAGES)

    @app.post("/sessions/{sid}/v1/messages/count_tokens", **route_doc(anthropic.CountTokensRequest, 400, 404, 413))
    async def count_tokens(sid: str, request: Request) -> Response:
        ctx = ctx_of()
        ctx.store.get(sid)
        body = await _read_body(request, ctx.settings.max_body_bytes)
        n = await state["runner"].prompt_tokens(sid, body, parse=ANTHROPIC_MESSAGES.parse_count)
        return _json({"input_tokens": n})

    @app.post(
        "/sessions/{sid}/v1/responses",
        **route_doc(OPENAI_RESPONSES.request_model, 400, 404, 409, 413, 429, 502, 503, 504,
                    media=(JSON, "text/event-stream")),
    )
    async def responses(sid: str, request: Request) -> Response:
        ctx = ctx_of()
        s = ctx.store.get(sid)
        return await dialect_turn(
            sid, request, OPENAI_RESPONSES,
            parse=OPENAI_RESPONSES.parser(s, ctx.tokenizer),  # previous_response_id resolves in this session
            committed=lambda req, out: OPENAI_RESPONSES.remember(s, req, out, ctx.tokenizer),
        )

    @app.get("/sessions/{sid}/v1/responses/{response_id}", **route_doc(None, 404))
    async def get_response(sid: str, response_id: str) -> Response:
        store = ctx_of().store
        s = store.get(sid)
        store.touch(s)
        return Response(content=OPENAI_RESPONSES.stored_body(s, response_id), media_type=JSON)

    _add_routes(app, samples.router, control.router, engines.router, models.router)
    return app


def _add_routes(app: FastAPI, *routers: APIRouter) -> None:
    """Each router's routes on the app itself, in order. `include_router` (FastAPI 0.165)
    would add one nested route per router instead: matched twice on every request, and
    hidden from `app.routes` (which the auth table and the client tests read)."""
    for router in routers:
        app.router.routes.extend(router.routes)
