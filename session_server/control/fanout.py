"""Engine fan-out of the control plane: one control call on every engine at once.

Only the orchestration lives here; what each engine calls a pause mode, how it aborts
many requests and whether it takes a weight version are its adapter's (engines/).
`abort`: running requests return partial output with finish `abort`. `keep`: requests
freeze with their KV. `wait` (drain): the plane first drains our in-flight requests
with the gate closed (bounded by its `drain_timeout_s`; in a cluster every instance
drains before any pauses, control/cluster_pause.py), then each engine pauses in the
mode its adapter names for `wait` (`EngineAdapter.pause_mode`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from session_server.engines.base import EngineAdapter, version_pushing

__all__ = ["CallableSource", "EngineSource", "abort_lora_on", "fan_out", "pause_engine", "push_version"]

log = logging.getLogger(__name__)

Report = dict[str, dict[str, Any]]


class EngineSource(Protocol):
    """Where the plane finds the engines to fan out to (`engines.registry.EngineRegistry`)."""

    def adapters(self) -> Iterable[EngineAdapter]: ...


class CallableSource:
    """An `EngineSource` over a callable (tests and benches pass `lambda: [adapter]`)."""

    def __init__(self, fn: Callable[[], Iterable[EngineAdapter]]) -> None:
        self._fn = fn

    def adapters(self) -> Iterable[EngineAdapter]:
        return self._fn()


async def fan_out(
    adapters: Iterable[EngineAdapter],
    op: str,
    call: Callable[[EngineAdapter], Awaitable[dict[str, Any] | None]],
    on_failure: Callable[[str], None],
) -> Report:
    """Run `call` on every adapter concurrently; one engine's failure never hides another's.

    Keyed by base URL; `on_failure(op)` is called once per failed engine (metrics)."""
    targets = list(adapters)
    outcomes = await asyncio.gather(*(call(a) for a in targets), return_exceptions=True)
    report: Report = {}
    for a, out in zip(targets, outcomes, strict=True):
        key = str(a.base_url)
        if isinstance(out, BaseException):
            on_failure(op)
            log.warning("control %s failed on %s: %s", op, key, out)
            report[key] = {"ok": False, "error": f"{type(out).__name__}: {out}"}
        else:
            report[key] = {"ok": True, **(out or {})}
    return report


async def pause_engine(adapter: EngineAdapter, mode: str) -> dict[str, Any]:
    """Pause one engine in `mode`, under the name its adapter gives it. For `wait` the
    plane has drained our requests first."""
    engine_mode = adapter.pause_mode(mode)
    await adapter.pause(engine_mode)
    return {"engine_mode": engine_mode}


async def abort_lora_on(adapter: EngineAdapter, rids: Sequence[str]) -> dict[str, Any]:
    """Abort `rids` (one LoRA adapter's requests on this engine) in the engine's bulk form."""
    if rids:
        await adapter.abort_requests(rids)
    return {"aborted": len(rids)}


async def push_version(adapter: EngineAdapter, version: str) -> dict[str, Any]:
    """Set the version an engine reports, where its adapter declares it can."""
    pusher = version_pushing(adapter)
    if pusher is None:
        return {"pushed": False, "reason": f"no version endpoint for {adapter.protocol} engines"}
    return dict(await pusher.update_weight_version(version))
