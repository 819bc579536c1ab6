"""The engine registry: engine lifecycle, and the one way the server reaches an adapter.

Adding an engine builds its adapter from a spec (`sglang=URL`, `vllm=URL`, or a bare
URL whose protocol is detected), proves the URL speaks the declared protocol
(`admission_check.verify_engine`), asks SGLang for its DP size, and registers its targets in
the routing pool; removing one drops its targets and closes its client in the
background once its turns are done. Routes, the turn pipeline and the control plane
reach adapters only here (`adapter(engine_id)`, `adapters()`), through the typed
`EngineAdapter` protocol; `routing/pool.py` keeps only target bookkeeping, so the
routing policies and the simulator share it without any engine import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..errors import BadRequest, EngineError, NoHealthyEngine
from ..model_config import model_routed_shape
from ..routing.pool import Engine, EnginePool
from . import make_adapter
from .admission_check import EngineRefused, parse_engine_spec, verify_engine
from .base import EngineAdapter, dp_size_reporting, load_reporting, model_naming

__all__ = ["EngineRegistry"]

log = logging.getLogger("session_server")


class EngineRegistry:
    """Adapters by engine id, kept in step with the routing pool's engines and targets.

    `adapter_options` go to every adapter built from a spec (e.g. `offload`)."""

    @staticmethod
    def base_url_of(spec: str) -> str:
        """The base URL an engine address (`[protocol=]URL`) names, as engines are keyed
        here; a malformed one is a 400."""
        try:
            base_url = parse_engine_spec(spec)[1]
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        if not base_url:
            raise BadRequest("url must name an engine, e.g. http://gpu-node:30000")
        return base_url

    def __init__(self, pool: EnginePool, **adapter_options: Any) -> None:
        self.pool = pool
        self._adapters: dict[str, EngineAdapter] = {}
        self._options = adapter_options
        # removed engines' adapters until their client is closed: a turn that was on one
        # may still ask whether it answers (`answers_health`)
        self._retired: dict[str, EngineAdapter] = {}
        self._noted: dict[str, str] | None = None  # while joining a cluster: URL -> last op asked here
        # engine id -> its model's routed-experts (layers, topk, experts), read from the
        # config.json of the model it names (`learn_routed_shape`)
        self.routed_shapes: dict[str, tuple[int, int, int | None]] = {}

    # --- lifecycle ------------------------------------------------------------------------

    async def add(self, spec: str, *, dp_size: int | None = None) -> Engine:
        """Build an adapter for `spec` (protocol forced or detected) and add its DP targets.

        An engine that does not answer at start-up is added unhealthy: the active
        health check brings it in when it comes up. One that answers but not as its
        protocol, or a mistyped protocol, is a 400 (`BadRequest`)."""
        try:
            adapter: EngineAdapter = await make_adapter(spec, **self._options)
        except ValueError as exc:  # a mistyped protocol (`sglangg=...`)
            raise BadRequest(str(exc)) from exc
        healthy = True
        try:  # something that merely answers HTTP is not an engine
            await verify_engine(adapter)
        except EngineRefused as exc:
            await adapter.aclose()
            raise BadRequest(f"engine {spec!r} refused: {exc}") from exc
        except (EngineError, TimeoutError) as exc:
            log.warning("engine %s not reachable at start-up (%s); marked unhealthy", spec, exc)
            healthy = False
        if dp_size is None:
            dp_size = 1
            reporter = dp_size_reporting(adapter)  # SGLang reports dp_size; vLLM does not
            if reporter is not None and healthy:
                try:
                    dp_size = await reporter.dp_size()
                except EngineError as exc:
                    log.warning("engine %s not reachable at start-up (%s); marked unhealthy", spec, exc)
                    healthy = False
        shape = await learn_routed_shape(adapter) if healthy else None
        # added meanwhile (a relayed add racing a peer sync): one engine per URL. Checked
        # after the last await, so nothing can attach the same URL between check and attach
        already = self.find(spec)
        if already is not None:
            await adapter.aclose()
            return already
        eng = self.attach(f"e{self.pool.next_engine_number()}", adapter, dp_size)
        eng.healthy = healthy
        if shape is not None:
            self.routed_shapes[eng.id] = shape
        return eng

    def attach(self, engine_id: str, adapter: EngineAdapter, dp_size: int = 1) -> Engine:
        """Register an already built `adapter` as `engine_id` with its targets."""
        self._adapters[engine_id] = adapter
        return self.pool.add(engine_id, dp_size)

    def remove(self, engine_id: str, *, drain_s: float = 0.0) -> Engine | None:
        """Drop `engine_id`: new turns are refused at once; turns already on it finish
        (their generation is good) and its client closes in the background after them
        (bounded by `drain_s`), so the caller does not wait. None when unknown."""
        eng = self.pool.remove(engine_id)
        adapter = self._adapters.pop(engine_id, None)
        self.routed_shapes.pop(engine_id, None)
        if adapter is not None:
            self._retired[engine_id] = adapter
            task = asyncio.get_running_loop().create_task(self._retire(engine_id, adapter, drain_s))
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)
        return eng

    async def _retire(self, engine_id: str, adapter: EngineAdapter, drain_s: float) -> None:
        try:
            await _close_quietly(adapter, drain_s)
        finally:
            self._retired.pop(engine_id, None)

    async def aclose(self) -> None:
        """Close every engine's client (shutdown); one failure never stops the others."""
        for adapter in list(self._adapters.values()):
            await _close_quietly(adapter, 0.0)

    # --- access -----------------------------------------------------------------------------

    def adapter(self, engine_id: str) -> EngineAdapter:
        """The adapter of `engine_id`; `NoHealthyEngine` when it was removed."""
        adapter = self._adapters.get(engine_id)
        if adapter is None:
            raise NoHealthyEngine(f"engine {engine_id} was removed")
        return adapter

    def find(self, spec: str) -> Engine | None:
        """The engine already serving `spec`'s URL (any protocol prefix), or None: adding
        an engine twice is idempotent, and a cluster relays engine changes by URL."""
        try:
            url = parse_engine_spec(spec)[1]
        except ValueError:
            return None
        for engine_id, adapter in self._adapters.items():
            if adapter.base_url == url:
                return self.pool.engines.get(engine_id)
        return None

    # --- changes asked while joining a cluster (control/peer_sync.py) --------------------------

    def note_changes(self) -> dict[str, str]:
        """From now on remember each engine URL an add or remove was asked for (`note`),
        found or not: a peer sync must not undo it with an older read of its peers."""
        self._noted = {}
        return self._noted

    def note(self, spec: str, op: str) -> None:
        """`op` ("added" / "removed") was asked for `spec`'s URL (the engine routes call this)."""
        if self._noted is not None:
            try:
                self._noted[parse_engine_spec(spec)[1]] = op
            except ValueError:
                pass

    def stop_noting(self) -> None:
        self._noted = None

    def protocols(self) -> set[str]:
        """The protocols the registered engines speak."""
        return {a.protocol for a in self._adapters.values()}

    def routed_shape(self) -> tuple[int, int, int | None] | None:
        """The model's routed-experts shape as learned from an engine, None when none told."""
        return next(iter(self.routed_shapes.values()), None)

    def adapters(self) -> list[EngineAdapter]:
        """Every engine's adapter (the control plane's fan-out reads this on each call)."""
        return list(self._adapters.values())

    def _answering(self, engine_id: str) -> EngineAdapter:
        """The adapter of `engine_id`, or of a removed one whose client is not closed yet."""
        retired = self._retired.get(engine_id)
        return retired if retired is not None else self.adapter(engine_id)

    # --- health -------------------------------------------------------------------------------

    async def check_health(self, engine: Engine) -> None:
        """The active health check (`routing.health.health_check_loop`): raises unless the engine
        answers healthy (the load an engine reports is polled apart: `poll_loads`)."""
        adapter = self._answering(engine.id)
        if not await adapter.health():
            raise EngineError(f"{adapter.base_url} reported unhealthy")

    async def poll_load(self, engine: Engine, timeout_s: float = 5.0) -> None:
        """Ask `engine` for its own load (SGLang `/get_load`, vLLM `/metrics`; engines/load.py)
        and hand it to the routing pool; an engine that does not answer counts as unknown
        (nothing added), never as an error."""
        adapter = self._adapters.get(engine.id)
        reporter = None if adapter is None else load_reporting(adapter)
        by_rank: dict[int, int] | None = None
        if reporter is not None and engine.healthy:
            try:
                by_rank = await asyncio.wait_for(reporter.load_by_rank(), timeout_s)
            except Exception as exc:  # a load poll informs placement; it never fails anything
                log.debug("load poll of %s failed: %r", engine.id, exc)
        engine.reported_load = None if by_rank is None else [
            {"dp_rank": rank, "requests": n} for rank, n in sorted(by_rank.items())]
        self.pool.set_engine_load(engine.id, by_rank)

    async def poll_loads(self, interval_s: float) -> None:
        """Every `interval_s`, every engine's own load at once (instances that share
        engines learn each other's load from them); runs until cancelled."""
        while True:
            engines = list(self.pool.engines.values())
            await asyncio.gather(*(self.poll_load(e, timeout_s=max(1.0, interval_s)) for e in engines))
            await asyncio.sleep(interval_s)

    async def answers_health(self, engine_id: str, timeout_s: float = 2.0) -> bool:
        """A quick liveness check (after a connection dropped mid-request); any failure
        to answer is a "no". A removed engine answers until its client is closed."""
        try:
            adapter = self._answering(engine_id)
            return bool(await asyncio.wait_for(adapter.health(), timeout_s))
        except Exception:  # any failure to answer is a "no"
            return False

    # --- view -----------------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """`GET /engines`: engines with their protocol and URL, targets, and moves."""
        pool = self.pool
        return {
            "policy": pool.policy.name,
            "engines": [
                {
                    "id": e.id,
                    "protocol": self._adapters[e.id].protocol,
                    "base_url": self._adapters[e.id].base_url,
                    "dp_size": e.dp_size,
                    "healthy": e.healthy,
                    "reported_load": e.reported_load,
                }
                for e in pool.engines.values()
            ],
            "targets": [
                {
                    "id": t.id,
                    "in_flight": t.in_flight,
                    "sessions": len(t.sessions),
                    "resident_tokens": t.resident_tokens,
                    "pending_prefill_tokens": t.pending_prefill_tokens,
                }
                for t in pool.targets.values()
            ],
            "migrations": pool.migrations,
            "rehomes": pool.rehomes,
        }


_CLOSING: set[asyncio.Task[None]] = set()  # background closes: the loop keeps weak task refs


async def learn_routed_shape(adapter: EngineAdapter, timeout_s: float = 10.0) -> tuple[int, int, int | None] | None:
    """The routed-experts (layers, topk, experts) of the model `adapter` serves, from that
    model's config.json (model_config.py: no engine sends the numbers themselves, both
    name the model). None when the engine does not say or the config cannot be read here
    (an engine on another machine, a hub model not in the local cache): routing replay
    then needs the settings. Never fails an engine's admission."""
    naming = model_naming(adapter)
    if naming is None:
        return None
    try:
        path = await asyncio.wait_for(naming.served_model_path(), timeout_s)
        return None if path is None else await asyncio.to_thread(model_routed_shape, path)
    except Exception as exc:  # a best-effort read: the settings still supply the shape
        log.info("engine %s: no routed-experts shape learned (%r)", adapter.base_url, exc)
        return None


async def _close_quietly(adapter: EngineAdapter, drain_s: float) -> None:
    """Close `adapter`'s client after its in-flight generations (bounded); never raises."""
    with contextlib.suppress(Exception):
        await adapter.aclose(drain_s=drain_s)
