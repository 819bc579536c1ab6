"""Engine fan-out of the control plane: one control call on every engine at once.

Mode mapping. `abort`: both engines have it (running requests return partial
output with finish `abort`). `keep`: vLLM `keep`, SGLang `in_place` (requests
freeze with their KV). `wait` (drain): vLLM `wait`; SGLang has no drain mode, so
the gate is closed, our in-flight requests on that engine are drained (bounded by
the plane's `drain_timeout_s`), then it is frozen `in_place`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from session_server.engines.base import EngineAdapter

__all__ = ["abort_lora_on", "fan_out", "pause_engine", "push_version"]

log = logging.getLogger(__name__)

_SGLANG_MODE = {"abort": "abort", "keep": "in_place", "wait": "in_place"}

Report = dict[str, dict[str, Any]]


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


async def pause_engine(
    adapter: EngineAdapter, mode: str, drain: Callable[[str], Awaitable[bool]]
) -> dict[str, Any]:
    """Pause one engine in `mode` (mapped to its own name); `drain(base_url)` waits for
    our requests on it, for SGLang's missing `wait` mode."""
    if getattr(adapter, "protocol", None) == "sglang":
        if mode == "wait":  # SGLang has no drain mode: drain ours, then freeze
            drained = await drain(adapter.base_url)
            await adapter.pause(_SGLANG_MODE[mode])
            return {"engine_mode": "in_place", "drained": drained}
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
