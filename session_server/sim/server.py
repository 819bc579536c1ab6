"""The simulated SGLang / vLLM server (aiohttp.web): app assembly and the test controls.

A `SimEngine` is the engine core (`engine.EngineCore`: ranks, caches, the generate
loop, pause modes) served through its protocol's wire (`sglang_wire` / `vllm_wire`),
plus the `/sim/*` routes tests drive: fault injection (`POST|DELETE /sim/faults`),
the request log (`GET|DELETE /sim/requests`), the abort log (`GET /sim/aborts`) and
the reported weight version (`GET|POST /sim/weight_version`, what a weight update
sets) and the requests the `hold_*_stop` faults hold (`GET /sim/held`). It says it is
a simulator (`"simulated": true`) in its info endpoints;
generate responses carry only real fields.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from session_server.engines.base import session_tag
from session_server.loopback import serving_aiohttp
from session_server.sim.engine import EngineCore
from session_server.sim.faults import FAULT_KINDS
from session_server.sim.routed import RoutedSpec, model_spec
from session_server.sim.sampler import SimModel, sim_model_from_tokenizer
from session_server.sim.sglang_wire import SGLangWire
from session_server.sim.vllm_wire import VLLMWire
from session_server.sim.wire import json_response, padding_payload

log = logging.getLogger(__name__)

__all__ = ["FAULT_KINDS", "SimEngine", "load_sim_model", "run_sim_engine", "running_sim"]


class SimEngine(EngineCore):
    """One simulated engine (all its DP ranks) for protocol "sglang" or "vllm", servable.

    `padding` ("floats" | "base64") adds the benchmark's routed_experts payload to every
    final answer. `routed` is the simulated MoE (layers, topk, experts) whose
    deterministic routed experts answer routing replay ("model": the served model's
    config.json, as SGLang reads it, `sim.routed.model_spec`): SGLang when a request asks,
    vLLM on every answer when `return_routed_experts` (its server flag
    `--enable-return-routed-experts`). `incremental_streaming_output`: SGLang's server flag
    of that name (stream frames are deltas). The other keywords configure the core (`EngineCore`).
    """

    def __init__(self, protocol: str, model: SimModel, *, padding: str | None = None,
                 routed: RoutedSpec | str | None = "model", return_routed_experts: bool = False,
                 incremental_streaming_output: bool = False, **core: Any) -> None:
        super().__init__(protocol, model, **core)
        self.incremental_streaming_output = incremental_streaming_output
        self.padding = padding_payload(padding) if padding else None
        if isinstance(routed, str):
            if routed != "model":
                raise ValueError(f"routed must be a RoutedSpec, None or 'model', not {routed!r}")
            routed = model_spec(model.name)
        self.routed: RoutedSpec | None = routed
        self.return_routed_experts = return_routed_experts

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        r.add_get("/health", self.health)
        if self.protocol == "sglang":
            SGLangWire(self, self.padding, self.routed, self.incremental_streaming_output).add_routes(r)
        else:
            VLLMWire(self, self.padding, self.routed if self.return_routed_experts else None).add_routes(r)
        r.add_post("/sim/faults", self.sim_faults)
        r.add_delete("/sim/faults", self.sim_faults_clear)
        r.add_get("/sim/requests", self.sim_requests)
        r.add_get("/sim/aborts", self.sim_aborts)
        r.add_get("/sim/held", self.sim_held)
        r.add_get("/sim/weight_version", self.sim_weight_version)
        r.add_post("/sim/weight_version", self.sim_weight_version)
        r.add_delete("/sim/requests", self.sim_requests_clear)
        r.add_post("/sim/script", self.sim_script)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_shutdown(self, app: web.Application) -> None:
        self.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def sim_faults(self, request: web.Request) -> web.Response:
        """POST {"kind", "count"}: queue a fault for the next `count` requests."""
        try:
            body = msgspec.json.decode(await request.read())
            kind, count = str(body["kind"]), int(body.get("count", 1))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            return json_response({"error": f"expected {{kind, count}}: {exc}"}, 400)
        if kind not in FAULT_KINDS:
            return json_response({"error": f"unknown fault kind {kind!r}; known: {list(FAULT_KINDS)}"}, 400)
        self.faults.add(kind, count)
        return json_response({"pending": self.faults.pending()})

    async def sim_faults_clear(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return json_response({"pending": []})

    async def sim_script(self, request: web.Request) -> web.Response:
        """POST {"turns": [assistant message, ...], "session"?: sid}: script the policy
        (`ScriptedPolicy.set_script`) for that session's requests (kept under the
        session's tag, which is what its requests carry), or without a session
        for every request on the engine (said in the answer's `scope` and `warning`, and
        logged: a script left behind answers a later, unrelated run); {"turns": []}
        drops the script of that scope."""
        try:
            body = msgspec.json.decode(await request.read())
            session = body.get("session")
            if session is not None and (not isinstance(session, str) or not session):
                raise ValueError(f"session must be a non-empty string, got {session!r}")
            # requests name their session by its tag (engines/base.session_tag), never its id
            self.policy.set_script(body["turns"], None if session is None else session_tag(session))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            return json_response({"error": f"expected {{turns: [...], session?: str}}: {exc}"}, 400)
        if session is not None:
            return json_response({"turns": len(body["turns"]), "scope": "session", "session": session})
        warning = ("engine-wide script: every request of every session without a script of its own plays it "
                   "until it is replaced or dropped ({\"turns\": []}); pass \"session\" to scope it")
        if body["turns"]:
            log.warning("sim: %s", warning)
        return json_response({"turns": len(body["turns"]), "scope": "engine", "warning": warning})

    async def sim_aborts(self, request: web.Request) -> web.Response:
        """The abort log: every abort call received and every rid that ended aborted."""
        return json_response({"calls": self.abort_calls, "aborted": self.aborted_rids})

    async def sim_held(self, request: web.Request) -> web.Response:
        """The rids the `hold_*_stop` faults hold near their stop step now (a test pauses then)."""
        return json_response({"held": sorted(self.held)})

    async def sim_requests(self, request: web.Request) -> web.Response:
        return json_response(self.requests)

    async def sim_requests_clear(self, request: web.Request) -> web.Response:
        self.requests.clear()
        return json_response({"cleared": True})

    async def sim_weight_version(self, request: web.Request) -> web.Response:
        """GET: the version responses report; POST {"version"}: set it (a weight update's effect)."""
        if request.method == "POST":
            try:
                body = msgspec.json.decode(await request.read())
                version = body["version"]
            except (msgspec.DecodeError, KeyError, TypeError) as exc:
                return json_response({"error": f"expected {{version}}: {exc}"}, 400)
            if isinstance(version, bool) or not isinstance(version, str | int | float):
                return json_response({"error": f"version must be a str or number, not {version!r}"}, 400)
            self.weight_version = str(version)
        return json_response({"weight_version": self.weight_version})


def load_sim_model(tokenizer: Any) -> SimModel:
    """A SimModel from: a SimModel, "toy", a tokenizer family name (offline tokenizer),
    a tokenizer directory / hub-style path, or a loaded transformers tokenizer."""
    if isinstance(tokenizer, SimModel):
        return tokenizer
    if isinstance(tokenizer, str | Path):
        spec = str(tokenizer)
        if spec == "toy":
            from session_server.sim.toy import toy_model

            return toy_model()
        from transformers import AutoTokenizer

        path = Path(spec)
        if not path.exists():
            from session_server.sim.tokenizers import FAMILIES, cached_tokenizer_dir

            if spec in FAMILIES:
                path = cached_tokenizer_dir(spec)
        tok = AutoTokenizer.from_pretrained(str(path) if path.exists() else spec)
        return sim_model_from_tokenizer(tok, name=spec)
    return sim_model_from_tokenizer(tokenizer)


@contextlib.asynccontextmanager
async def running_sim(
    protocol: str,
    tokenizer: Any,
    *,
    seed: int = 0,
    dp: int = 1,
    latency_ms: float = 0.0,
    noncanonical: bool = False,
    padding: str | None = None,
    **engine_kwargs: Any,
) -> AsyncIterator[str]:
    """Serve a SimEngine on a free 127.0.0.1 port for the duration; yields its base URL."""
    engine = SimEngine(
        protocol, load_sim_model(tokenizer), seed=seed, dp=dp, latency_ms=latency_ms,
        noncanonical=noncanonical, padding=padding, **engine_kwargs,
    )
    async with serving_aiohttp(engine.make_app(), handler_cancellation=True) as url:
        yield url


def run_sim_engine(
    protocol: str,
    tokenizer: str,
    *,
    host: str = "127.0.0.1",
    port: int,
    seed: int = 0,
    dp: int = 1,
    latency_ms: float = 0.0,
    request_latency_ms: float = 0.0,
    noncanonical: bool = False,
    padding: str | None = None,
    routed: RoutedSpec | str | None = "model",
    return_routed_experts: bool = False,
    incremental_streaming_output: bool = False,
) -> None:
    """Blocking entry for `session-server sim-engine`."""
    engine = SimEngine(
        protocol, load_sim_model(tokenizer), seed=seed, dp=dp, latency_ms=latency_ms,
        request_latency_ms=request_latency_ms, noncanonical=noncanonical, padding=padding,
        routed=routed, return_routed_experts=return_routed_experts,
        incremental_streaming_output=incremental_streaming_output,
    )
    web.run_app(engine.make_app(), host=host, port=port, handler_cancellation=True,
                shutdown_timeout=1.0, access_log=None)
