"""Engine fan-out of the control plane: one control call on every engine at once.

Mode mapping. `abort`: both engines have it (running requests return partial
output with finish `abort`). `keep`: vLLM `keep`, SGLang `in_place` (requests
freeze with their KV). `wait` (drain): the plane first drains our in-flight requests
with the gate closed (bounded by its `drain_timeout_s`; in a cluster every instance
drains before any pauses, control/cluster_pause.py), then vLLM pauses `wait` and
SGLang, which has no drain mode, is frozen `in_place`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from session_server.engines.base import EngineAdapter

__all__ = ["CallableSource", "EngineSource", "abort_lora_on", "fan_out", "pause_engine", "push_version"]

log = logging.getLogger(__name__)

_SGLANG_MODE = {"abort": "abort", "keep": "in_place", "wait": "in_place"}

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
        key = str(getattr(a, "base_url", repr(a)))
        if isinstance(out, BaseException):
            on_failure(op)
            log.warning("control %s failed on %s: %s", op, key, out)
            report[key] = {"ok": False, "error": f"{type(out).__name__}: {out}"}
        else:
            report[key] = {"ok": True, **(out or {})}
    return report


async def pause_engine(adapter: EngineAdapter, mode: str) -> dict[str, Any]:
    """Pause one engine in `mode` (mapped to its own name). For `wait` the plane has
    drained our requests first (SGLang has no drain mode: it is then frozen in place)."""
    if getattr(adapter, "protocol", None) == "sglang":
        await adapter.pause(_SGLANG_MODE[mode])
        return {"engine_mode": _SGLANG_MODE[mode]}
    await adapter.pause(mode)
    return {"engine_mode": mode}


async def abort_lora_on(adapter: Any, rids: Sequence[str]) -> dict[str, Any]:
    """Abort `rids` (one LoRA adapter's requests on this engine) with the engine's bulk
    `abort`: SGLang takes one id per call, vLLM a list."""
    if rids:
        if getattr(adapter, "protocol", None) == "sglang":
            await asyncio.gather(*(adapter.abort(rid) for rid in rids))
        else:
            await adapter.abort(list(rids))
    return {"aborted": len(rids)}


async def push_version(adapter: Any, version: str) -> dict[str, Any]:
    """Set the version an engine reports (`update_weight_version`), where its adapter can."""
    update = getattr(adapter, "update_weight_version", None)
    if update is None:
        return {"pushed": False, "reason": f"no version endpoint for {getattr(adapter, 'protocol', '?')} engines"}
    return dict(await update(version))
