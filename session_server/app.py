"""App factory: the assembler. It builds the app, registers the one error map
(`api/error_map.py`), auth and the routers (`api/routes/`), and runs the lifespan
(`lifecycle.py` builds, joins the cluster, and stops what the routes share).

The routes read what they share from `app.state` (`api/routes/common.py`): the context
(`ctx`), the peer relay (`relay`) and the turn entry point (`turns`, `api/turn_endpoint.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI

from .api import ui, ui_data, ui_line
from .api.dialects import OPENAI_RESPONSES
from .api.dialects import anthropic_messages as anthropic
from .api.direct import DirectTurns
from .api.edge import install_openapi
from .api.error_map import count_error, install_error_map
from .api.models import (
    EngineAdd,
    PauseRequest,
    ResumeRequest,
    RewardRequest,
    SamplesBatch,
    SessionCreate,
    WeightVersion,
)
from .api.routes import control, engines, health, models, samples, sessions, turns
from .api.routes.sessions import session_view
from .api.turn_endpoint import TurnEndpoint
from .auth import install_auth, new_instance_id
from .durability import recover, stable_instance_id
from .lifecycle import (
    AppConfig,
    build_context,
    join_cluster,
    open_relay,
    shutdown,
    start_background,
)
from .turn.chat_request import ChatRequest

__all__ = ["AppConfig", "create_app", "session_view"]


def create_app(config: AppConfig) -> FastAPI:
    if config.settings.instance_id is None:  # one identity per app: /health and the session-id prefix
        fresh = new_instance_id()
        if config.settings.journal_dir is not None:  # journaled sessions keep their ids over a restart
            fresh = stable_instance_id(config.settings.journal_dir, fresh)
        config = dataclasses.replace(config, settings=config.settings.model_copy(update={"instance_id": fresh}))
    settings = config.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = await build_context(config)
        app.state.ctx = ctx
        app.state.turns = endpoint = TurnEndpoint(ctx)  # every turn route's one entry (api/routes/turns.py)
        app.state.runner = endpoint.runner
        app.state.relay = relay = open_relay(settings)
        background = start_background(ctx)
        if ctx.journal is not None:  # sessions come back before the gate opens
            background.tasks.append(asyncio.create_task(recover(ctx, endpoint.replays), name="tito-recovery"))
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
    # the turn routes skip FastAPI's routing; inside auth, outside the error map's containment
    app.add_middleware(DirectTurns, on_error=lambda: count_error(app.state, "internal_error"))
    install_openapi(
        app,
        [SessionCreate, ChatRequest, anthropic.MessagesRequest, anthropic.CountTokensRequest, OPENAI_RESPONSES.request_model,
         PauseRequest, ResumeRequest, WeightVersion, EngineAdd, RewardRequest, SamplesBatch],
    )
    app.state.model_name = models.served_model_name(config.tokenizer)
    install_auth(app, settings.admin_token)
    _add_routes(app, health.router, sessions.router, turns.router, samples.router, control.router, engines.router,
                models.router, ui_data.router, ui_line.router, ui.router)
    return app


def _add_routes(app: FastAPI, *routers: APIRouter) -> None:
    """Each router's routes on the app itself, in order. `include_router` (FastAPI 0.165)
    would add one nested route per router instead: matched twice on every request, and
    hidden from `app.routes` (which the auth table and the client tests read)."""
    for router in routers:
        app.router.routes.extend(router.routes)
