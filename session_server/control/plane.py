"""The server-wide weight-update control plane: pause state, versions, salts, fan-out.

`ControlPlane` owns the server-side pause gate (global and per LoRA adapter), the
fan-out of pause/resume and of the trainer's weight version to every engine through
the adapters' own control methods (fanout.py) with per-engine failure reports, the
in-flight request registry (to abort one adapter's requests by id and to drain), the
monotone weight version with its per-version cache salt, and the control metrics
(metrics.py, their one source). The per-turn loop (resilient.py) uses its public methods.

Engines cannot pause one LoRA adapter, so a per-LoRA pause is enforced here: the
gate blocks that adapter's new segments; `abort` also aborts its in-flight requests
by id, `wait` drains them, `keep` lets them run on. A `wait` that cannot drain in
`drain_timeout_s` pauses no engine and says so (`drained: false`): never an `ok`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from session_server.engines.base import EngineAdapter
from session_server.errors import BadRequest, PausedTooLong

from . import fanout
from .fanout import EngineSource, Report, abort_lora_on, fan_out, pause_engine, push_version
from .flights import EngineAborts, Flights
from .metrics import ControlMetrics

__all__ = ["MAX_WEIGHT_VERSION", "PAUSE_MODES", "ControlPlane", "EngineSource"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "keep", "wait")
MAX_WEIGHT_VERSION = 2**53 - 1  # the largest integer every JSON client reads exactly


@dataclass
class _Pause:
    mode: str
    since: float  # monotonic
    since_unix: float


class ControlPlane:
    """Engine-agnostic pause gate + engine fan-out + weight version (see module doc).
    `engines.adapters()` is read on every fan-out: engines added or removed later are seen."""

    def __init__(
        self,
        engines: EngineSource | Callable[[], Iterable[EngineAdapter]],
        *,
        metrics_registry: CollectorRegistry | None = None,
        grace_s: float = 0.05,
        drain_timeout_s: float = 60.0,
        weight_version: int | None = None,
        salt_cache: bool = True,
        max_empty_aborts: int = 8,
        abort_timeout_s: float = 2.0,
    ) -> None:
        self._engines: EngineSource = fanout.CallableSource(engines) if callable(engines) else engines
        self.on_weight_version: list[Callable[[int], None]] = []  # each new version (the pool, lag.py)
        self.on_resume: list[Callable[[], None]] = []  # as the engines resume (versions.py: splits)
        self.metrics = ControlMetrics(metrics_registry)
        self.flights = Flights()
        self.aborts = EngineAborts(self.metrics, abort_timeout_s)
        self.grace_s = grace_s
        self.drain_timeout_s = drain_timeout_s
        self.salt_cache = salt_cache
        self.max_empty_aborts = max_empty_aborts
        self._global: _Pause | None = None
        self._lora: dict[str, _Pause] = {}
        self._version: int | None = None
        self._forced_reset = False  # a version was forced backwards at least once
        self._changed = asyncio.Event()  # replaced on every gate change (broadcast)
        self._waiting = 0
        self._epoch = 0  # +1 per pause: tells a pause abort from an engine-side one
        self._lock = asyncio.Lock()  # one pause/resume at a time
        self.last_mismatch: dict[str, Any] | None = None
        self.last_report: dict[str, Any] | None = None
        self._touched: set[str] | None = None  # joining (peer_sync.py): what changes applied here set
        if weight_version is not None:
            self.set_weight_version(weight_version)

    # --- gate ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self.metrics.paused.set(1 if self._global else 0)
        self.metrics.lora_paused.set(len(self._lora))

    def blocked(self, lora: str | None = None) -> bool:
        """Whether a new segment for `lora` must wait (global pause, or that adapter paused)."""
        return self._global is not None or self._touched is not None or (lora is not None and lora in self._lora)

    async def wait_open(self, lora: str | None = None, *, deadline: float | None = None) -> float:
        """Wait until the gate is open for `lora`; seconds waited.

        Raises `PausedTooLong` when the monotonic `deadline` passes while paused."""
        if not self.blocked(lora):
            return 0.0
        t0 = time.monotonic()
        self._waiting += 1
        try:
            while self.blocked(lora):
                changed = self._changed
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.metrics.paused_too_long_total.inc()
                    scope = "the server" if self._global or not self.synced else f"LoRA adapter {lora!r}"
                    raise PausedTooLong(
                        f"{scope} stayed paused past the turn's deadline "
                        f"(waited {time.monotonic() - t0:.3f}s)"
                    )
                try:
                    await asyncio.wait_for(changed.wait(), left)
                except TimeoutError:
                    continue
        finally:
            self._waiting -= 1
            waited = time.monotonic() - t0
            self.metrics.paused_wait_seconds.observe(waited)
        return waited

    # --- in-flight registry ----------------------------------------------------------------

    def track_flight(self, rid: str, *, engine: str, lora: str | None) -> AbstractContextManager[None]:
        """Register segment `rid` as at `engine` while the block runs: a per-LoRA abort
        finds it by id, a drain waits for it to leave."""
        return self.flights.track(rid, engine=engine, lora=lora)

    def in_flight(self, *, engine: str | None = None, lora: str | None = None) -> list[str]:
        """Request ids of segments now at an engine (optionally one engine / one LoRA)."""
        return self.flights.ids(engine=engine, lora=lora)

    # --- engine fan-out ----------------------------------------------------------------------

    async def _fan_out(self, op: str, call: Callable[[EngineAdapter], Any]) -> Report:
        return await fan_out(self._engines.adapters(), op, call,
                             lambda failed_op: self.metrics.engine_failures_total.labels(op=failed_op).inc())

    def _report(self, action: str, mode: str | None, lora: str | None, t0: float,
                engines: Report, **extra: Any) -> dict[str, Any]:
        failed = sorted(k for k, v in engines.items() if not v["ok"])
        report = {
            "action": action, "mode": mode, "lora": lora,
            "ok": not failed and extra.get("drained", True) and not extra.get("superseded"),
            "engines": engines, "failed": failed, "elapsed_s": time.monotonic() - t0, **extra,
        }
        self.last_report = report
        return report

    # --- pause / resume -----------------------------------------------------------------------

    async def pause(self, mode: str, lora: str | None = None, *, phase: str | None = None) -> dict[str, Any]:
        """Close the gate (globally or for `lora`), wait the grace period, then pause engines.

        `wait` first drains this instance's segments (bounded by `drain_timeout_s`) and
        pauses engines only once drained: a report with `drained: false` paused no engine
        and left the gate closed (the app answers it 504). `phase` splits a global `wait`
        in two for a cluster (control/cluster_pause.py): `drain` (gate and drain only),
        then `freeze` (the engines), so no instance freezes a shared engine under a peer's
        turns. Never raises for an engine's failure: the report lists each engine's outcome."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise BadRequest(f"lora must be a non-empty string, not {lora!r}")
        if phase is not None and (mode != "wait" or lora is not None or phase not in ("drain", "freeze")):
            raise BadRequest(f"phase {phase!r} is only for a global wait pause (drain, then freeze)")
        if phase == "freeze":
            return await self._freeze(time.monotonic(), drained=True)
        async with self._lock:
            t0 = time.monotonic()
            scope = "global" if lora is None else "lora"
            pause = _Pause(mode, t0, time.time())
            if lora is None:
                self._global = pause
            else:
                self._lora[lora] = pause
            self._epoch += 1
            self._touch("global" if lora is None else f"lora:{lora}")
            self._notify()
            self.metrics.pauses_total.labels(scope=scope, mode=mode).inc()
            if self.grace_s > 0:
                # requests that passed the gate but are still in transit reach the engine
                await asyncio.sleep(self.grace_s)
            if mode == "wait":  # the engines pause only once this instance's turns are done
                drained = await self.flights.drain(self.drain_timeout_s, lora=lora)
                if not drained or lora is not None or phase == "drain":
                    return self._report("pause", mode, lora, t0, {}, drained=drained,
                                        in_flight=len(self.in_flight(lora=lora)), engines_paused=False)
            elif lora is not None:
                engines = await self._fan_out("abort", lambda a: abort_lora_on(
                    a, self.in_flight(engine=a.base_url, lora=lora))) if mode == "abort" else {}
                return self._report("pause", mode, lora, t0, engines)
            else:
                engines = await self._fan_out("pause", lambda a: pause_engine(a, mode))
                return self._report("pause", mode, lora, t0, engines)
        return await self._freeze(t0, drained=True)

    async def _freeze(self, t0: float, *, drained: bool) -> dict[str, Any]:
        """The engines of a drained global `wait` pause are paused (SGLang frozen in place);
        refused when the gate was reopened or repaused in another mode meanwhile."""
        async with self._lock:
            if self._global is None or self._global.mode != "wait":
                return self._report("pause", "wait", None, t0, {}, drained=drained, engines_paused=False,
                                    superseded=True)
            engines = await self._fan_out("pause", lambda a: pause_engine(a, "wait"))
            return self._report("pause", "wait", None, t0, engines, drained=drained, engines_paused=True)

    async def resume(self, lora: str | None = None) -> dict[str, Any]:
        """Resume engines (global) and open the gate; the gate opens even if an engine failed,
        so turns are not stuck behind one engine (the report names it; resume again)."""
        async with self._lock:
            t0 = time.monotonic()
            was = self._global if lora is None else self._lora.get(lora)
            await self.drain_aborts()  # requests cut at an update (lag.py) stop before engines resume
            if lora is None:
                for hook in list(self.on_resume):
                    hook()
                engines = await self._fan_out("resume", lambda a: a.resume())
                self._global = None
            else:
                engines = {}
                self._lora.pop(lora, None)
            self._touch("global" if lora is None else f"lora:{lora}")
            self._notify()
            self.metrics.resumes_total.labels(scope="global" if lora is None else "lora").inc()
            return self._report(
                "resume", None, lora, t0, engines, was_paused=was is not None,
                paused_s=None if was is None else t0 - was.since,
            )

    # --- weight version ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int | None:
        return self._version

    def set_weight_version(self, version: Any, *, force: bool = False) -> dict[str, Any]:
        """`POST /control/weight_version {"version": N, "force": false}`: monotone; going
        backwards is a 400 unless `force` (the reset path, logged). Versions stay within
        JSON-safe integers so a huge value cannot lock out every later update."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_WEIGHT_VERSION:
            raise BadRequest(f"weight version must be an int in [0, 2**53 - 1], not {version!r}")
        if not isinstance(force, bool):
            raise BadRequest(f"force must be a boolean, not {force!r}")
        previous = self._version
        if previous is not None and version < previous:
            if not force:
                raise BadRequest(
                    f"weight version {version} is older than the current {previous} "
                    "(send force: true to reset)"
                )
            log.warning("weight version forced backwards: %s -> %s", previous, version)
            self._forced_reset = True
        self._apply_version(version)
        self._touch("version")
        out: dict[str, Any] = {"weight_version": version, "previous": previous, "cache_salt": self.cache_salt()}
        if previous is not None and version < previous:
            out["forced"] = True
        return out

    def restore_weight_version(self, version: int) -> None:
        """The journal's version (start-up), unless one is set (a peer's: newer); not a change made here."""
        if self._version is None:
            self._apply_version(version)

    def _apply_version(self, version: int) -> None:
        previous = self._version
        self._version = version
        self.metrics.weight_version.set(version)
        if version != previous:
            for hook in list(self.on_weight_version):
                try:
                    hook(version)
                except Exception:  # a hook never blocks a weight update
                    log.exception("weight-version hook failed")

    # --- joining a running cluster (peer_sync.py) -------------------------------------------------

    def begin_sync(self) -> None:
        """Close the gate until `adopt` / `end_sync`; from now on remember what each applied
        pause, resume and version set: newer than an overlapping read, `adopt` keeps it."""
        self._touched = set()
        self._notify()

    @property
    def synced(self) -> bool:  # False between `begin_sync` and `adopt` / `end_sync`: the gate is closed
        return self._touched is None

    def _touch(self, what: str) -> None:
        if self._touched is not None:
            self._touched.add(what)

    def adopt(self, *, weight_version: int | None, pause_mode: str | None, lora_pauses: dict[str, str]) -> None:
        """Take the peers' state except what changes applied since `begin_sync` set; open the
        gate. No engine is asked: they are shared and the peers already paused them."""
        touched = self._touched or set()
        if weight_version is not None and "version" not in touched:
            self._apply_version(weight_version)
        now, now_unix = time.monotonic(), time.time()
        if "global" not in touched:
            self._global = None if pause_mode is None else _Pause(pause_mode, now, now_unix)
        kept = {name: p for name, p in self._lora.items() if f"lora:{name}" in touched}
        self._lora = {name: _Pause(mode, now, now_unix) for name, mode in lora_pauses.items()
                      if f"lora:{name}" not in touched} | kept
        self.end_sync()

    def end_sync(self) -> None:
        """Open the gate on the state as it is (nothing adopted when no peer answered)."""
        self._touched = None
        self._notify()

    def version_floor(self, last: Any) -> Any:
        """The version a session's next turn may not go below: its last committed one,
        except after a forced reset, when versions newer than the current one belong to
        the abandoned run (else every existing session's turn would be a 502)."""
        if not self._forced_reset or self._version is None or last is None:
            return last
        try:
            newer = float(last) > self._version
        except (TypeError, ValueError):  # opaque versions are not ordered
            return last
        return None if newer else last

    def abort_engine_request(self, adapter: Any, rid: str) -> None:
        """Abort `rid` on its engine in the background: the turn stopped waiting for it
        (cancelled or timed out), so the engine must not keep decoding for nobody. Never
        blocks the caller; bounded by `abort_timeout_s`; counted by outcome."""
        self.aborts.send(adapter, rid)

    async def drain_aborts(self) -> None:
        """Wait for the background aborts in flight (shutdown, tests)."""
        await self.aborts.drain()

    def cache_salt(self) -> str | None:
        """Prefix-cache namespace of the current weights (vLLM `cache_salt`, SGLang `extra_key`),
        so KV computed under older weights is never reused; None when unversioned."""
        if not self.salt_cache or self._version is None:
            return None
        return f"wv-{self._version}"

    def record_version_mismatch(self, engine: str, reported: Any) -> None:
        """An engine reported a version the trainer did not go through (versions.py)."""
        self.metrics.version_mismatch_total.inc()
        self.last_mismatch = {"engine": engine, "reported": reported, "expected": self._version,
                              "at_unix": time.time()}

    async def push_weight_version(self, out: dict[str, Any]) -> dict[str, Any]:
        """Every engine told the version `set_weight_version` applied (`out`, its answer):
        per engine `pushed: false` without such an endpoint, `ok: false` on failure."""
        engines = await self._fan_out("weight_version", lambda a: push_version(a, str(out["weight_version"])))
        failed = sorted(k for k, v in engines.items() if not v["ok"])
        return {**out, "ok": not failed, "engines": engines, "failed": failed}

    # --- view ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """`GET /control/state`."""
        now = time.monotonic()
        g = self._global
        return {
            "paused": g is not None,
            "mode": None if g is None else g.mode,
            "paused_since_unix": None if g is None else g.since_unix,
            "paused_for_s": None if g is None else now - g.since,
            "lora_pauses": {name: {"mode": p.mode, "paused_since_unix": p.since_unix, "paused_for_s": now - p.since}
                            for name, p in sorted(self._lora.items())},
            "weight_version": self._version,
            "synced": self.synced,
            "cache_salt": self.cache_salt(),
            "grace_s": self.grace_s,
            "in_flight": len(self.flights),
            "waiting_at_gate": self._waiting,
            "counters": self.metrics.totals(),
            "last_version_mismatch": self.last_mismatch,
            "last_report": self.last_report,
        }

    # --- per-turn accounting (called by generate_resilient) -----------------------------------

    def record_abort(self, *, empty: bool) -> None:
        """A turn segment ended with finish `abort` (`empty`: without a token)."""
        self.metrics.aborts_total.inc()
        if empty:
            self.metrics.empty_aborts_total.inc()

    def record_resubmit(self) -> None:
        """A turn resubmits prompt + partial after an abort."""
        self.metrics.resubmits_total.inc()
