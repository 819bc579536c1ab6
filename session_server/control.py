"""The weight-update control plane: pause, abort, resume without losing a token (DESIGN.md s9).

Owns
- `ControlPlane`: the server-side pause gate (global and per LoRA adapter), the
  fan-out of pause/resume to every engine through the adapters' own control
  methods (SGLang `/pause_generation` + `/continue_generation`, vLLM
  `/pause?mode=` + `/resume`) with per-engine failure reports, the in-flight
  request registry (to abort one adapter's requests by id and to drain), the
  monotone weight version with its per-version cache salt, and the global
  control metrics;
- `generate_resilient`: one turn as abort -> accumulate -> resubmit segments,
  returned as one `ResilientResult` (a `GenerateResult` plus weight spans and
  per-turn counters) that is indistinguishable from an uninterrupted generation.

Mode mapping. `abort`: both engines have it (running requests return partial
output with finish `abort`). `keep`: vLLM `keep`, SGLang `in_place` (requests
freeze with their KV). `wait` (drain): vLLM `wait`; SGLang has no drain mode, so
the gate is closed, our in-flight requests on that engine are drained (bounded by
`drain_timeout_s`), then it is frozen `in_place`. Engines cannot pause one LoRA
adapter, so a per-LoRA pause is enforced here: the gate blocks that adapter's new
segments; `abort` also aborts its in-flight requests by id, `wait` drains them,
`keep` lets them run on.

Weight versions per token. Each segment's version is the one its engine reply
reports (SGLang `meta_info.weight_version`); when the engine reports none (vLLM)
it is the control plane's version when the segment was dispatched, which is exact
for `abort` and `wait` pauses (a segment never runs across an update) and, for a
`keep` pause, attributes a segment frozen across an update to the old version.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from session_server.engines.base import GenerateRequest, GenerateResult, TokenIds
from session_server.errors import (
    BadRequest,
    EngineAborted,
    PausedTooLong,
    UpstreamInvalid,
    UpstreamTimeout,
)
from trajectory.errors import ValidationError
from trajectory.validate import Expectations, validate_generation

__all__ = [
    "PAUSE_MODES",
    "AbortEvent",
    "ControlMetrics",
    "ControlPlane",
    "ResilientResult",
    "WeightSpan",
    "generate_resilient",
    "new_request_id",
]

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "keep", "wait")
_SGLANG_MODE = {"abort": "abort", "keep": "in_place", "wait": "in_place"}
MAX_WEIGHT_VERSION = 2**53 - 1  # the largest integer every JSON client reads exactly

_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

WeightSpan = tuple[int, int, Any]


_RID_PREFIX = secrets.token_hex(8)  # per process: ids of two server processes never collide
_rid_counter = itertools.count()


def new_request_id() -> str:
    """A fixed-width (32 hex chars) id: SGLang aborts by rid *prefix*, so ids must be
    prefix-free; equal width makes them so. Random per process, then a counter
    (no syscall per request)."""
    return f"{_RID_PREFIX}{next(_rid_counter):016x}"


class ControlMetrics:
    """Global control-plane metrics, registered on the server's registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = r
        self.pauses_total = Counter(
            "tito_control_pauses_total", "Pause requests, by scope and mode", ["scope", "mode"], registry=r
        )
        self.resumes_total = Counter(
            "tito_control_resumes_total", "Resume requests, by scope", ["scope"], registry=r
        )
        self.engine_failures_total = Counter(
            "tito_control_engine_failures_total", "Engine control calls that failed, by operation",
            ["op"], registry=r,
        )
        self.paused = Gauge("tito_control_paused", "1 while globally paused", registry=r)
        self.lora_paused = Gauge("tito_control_lora_paused", "LoRA adapters currently paused", registry=r)
        self.weight_version = Gauge("tito_weight_version", "Current weight version (-1 unset)", registry=r)
        self.weight_version.set(-1)
        self.version_mismatch_total = Counter(
            "tito_weight_version_mismatch_total",
            "Engine replies whose weight version differs from the control plane's", registry=r,
        )
        self.aborts_total = Counter(
            "tito_turn_aborts_total", "Generation segments that ended with finish abort", registry=r
        )
        self.empty_aborts_total = Counter(
            "tito_turn_empty_aborts_total", "Aborted segments that produced no token", registry=r
        )
        self.resubmits_total = Counter(
            "tito_turn_resubmits_total", "Resubmissions of prompt + partial after an abort", registry=r
        )
        self.paused_too_long_total = Counter(
            "tito_turn_paused_too_long_total", "Turns whose deadline passed while paused", registry=r
        )
        self.engine_aborts_total = Counter(
            "tito_engine_aborts_sent_total",
            "Engine requests aborted because their turn stopped waiting (cancel, timeout), by outcome",
            ["outcome"], registry=r,
        )
        self.paused_wait_seconds = Histogram(
            "tito_turn_paused_wait_seconds", "Time a turn segment waited at the closed pause gate",
            buckets=_WAIT_BUCKETS_S, registry=r,
        )


@dataclass
class _Pause:
    mode: str
    since: float  # monotonic
    since_unix: float


@dataclass
class _Flight:
    engine: str
    lora: str | None


@dataclass(frozen=True)
class AbortEvent:
    """Passed to `on_abort` after each aborted segment (e.g. to add a session note)."""

    request_id: str  # the turn's (original) id
    segment_request_id: str
    segment: int
    new_tokens: int
    total_tokens: int
    remaining: int
    paused: bool  # the gate was closed when the abort arrived


@dataclass(frozen=True)
class ResilientResult(GenerateResult):
    """One turn's engine output across any number of aborted segments.

    The inherited fields look like one uninterrupted `GenerateResult` (request id
    of the turn, prompt_tokens of the original prompt, concatenated raw ids and
    logprobs), so `validate_generation` takes it as is."""

    weight_spans: tuple[WeightSpan, ...] = ()  # relative to the sampled ids
    segments: int = 1
    segment_request_ids: tuple[str, ...] = ()
    aborts: int = 0
    empty_aborts: int = 0
    resubmits: int = 0
    paused_wait_s: float = 0.0
    version_mismatches: int = 0
    dropped_tokens: int = 0  # constrained partials discarded and regenerated (never committed)

    def counters(self) -> dict[str, Any]:
        """Per-turn control counters, for the session view."""
        return {
            "segments": self.segments,
            "aborts": self.aborts,
            "empty_aborts": self.empty_aborts,
            "resubmits": self.resubmits,
            "paused_wait_s": self.paused_wait_s,
            "version_mismatches": self.version_mismatches,
            "dropped_tokens": self.dropped_tokens,
        }


class ControlPlane:
    """Engine-agnostic pause gate + engine fan-out + weight version (see module doc).

    `adapters` is called on every fan-out so engines added or removed later are seen;
    each adapter needs `protocol`, `base_url`, `pause(mode)`, `resume()` and `abort(...)`.
    """

    def __init__(
        self,
        adapters: Callable[[], Iterable[Any]],
        *,
        registry: CollectorRegistry | None = None,
        grace_s: float = 0.05,
        drain_timeout_s: float = 60.0,
        weight_version: int | None = None,
        salt_cache: bool = True,
        max_empty_aborts: int = 8,
        abort_timeout_s: float = 2.0,
    ) -> None:
        self._adapters = adapters
        self.abort_timeout_s = abort_timeout_s
        self._abort_tasks: set[asyncio.Task[None]] = set()
        # called with the new version after every weight-version change (the pool drops
        # cached-prefix estimates: the salt changed, so no old prefix is reusable)
        self.on_weight_version: list[Callable[[int], None]] = []
        self.metrics = ControlMetrics(registry)
        self.grace_s = grace_s
        self.drain_timeout_s = drain_timeout_s
        self.salt_cache = salt_cache
        self.max_empty_aborts = max_empty_aborts
        self._global: _Pause | None = None
        self._lora: dict[str, _Pause] = {}
        self._version: int | None = None
        self._forced_reset = False  # a version was forced backwards at least once
        self._changed = asyncio.Event()  # replaced on every gate change (broadcast)
        self._flights: dict[str, _Flight] = {}
        self._flights_changed = asyncio.Event()
        self._waiting = 0
        self._epoch = 0  # +1 per pause: tells a pause abort from an engine-side one
        self._lock = asyncio.Lock()  # one pause/resume at a time
        self.counters: dict[str, float] = {
            "pauses": 0, "resumes": 0, "aborts": 0, "empty_aborts": 0, "resubmits": 0,
            "paused_wait_s": 0.0, "paused_too_long": 0, "version_mismatches": 0,
            "engine_failures": 0,
        }
        self.last_mismatch: dict[str, Any] | None = None
        self.last_report: dict[str, Any] | None = None
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
        return self._global is not None or (lora is not None and lora in self._lora)

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
                    self.counters["paused_too_long"] += 1
                    self.metrics.paused_too_long_total.inc()
                    scope = "the server" if self._global else f"LoRA adapter {lora!r}"
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
            self.counters["paused_wait_s"] += waited
            self.metrics.paused_wait_seconds.observe(waited)
        return waited

    # --- in-flight registry ----------------------------------------------------------------

    def _enter(self, rid: str, engine: str, lora: str | None) -> None:
        self._flights[rid] = _Flight(engine, lora)

    def _exit(self, rid: str) -> None:
        if self._flights.pop(rid, None) is not None:
            self._flights_changed.set()
            self._flights_changed = asyncio.Event()

    def in_flight(self, *, engine: str | None = None, lora: str | None = None) -> list[str]:
        """Request ids of segments now at an engine (optionally one engine / one LoRA)."""
        return [
            rid for rid, f in self._flights.items()
            if (engine is None or f.engine == engine) and (lora is None or f.lora == lora)
        ]

    async def _drain(self, *, engine: str | None = None, lora: str | None = None) -> bool:
        """Wait until no matching segment is in flight; False when `drain_timeout_s` passed."""
        deadline = time.monotonic() + self.drain_timeout_s
        while self.in_flight(engine=engine, lora=lora):
            changed = self._flights_changed
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                continue
        return True

    # --- engine fan-out ----------------------------------------------------------------------

    async def _fan_out(
        self, op: str, call: Callable[[Any], Awaitable[dict[str, Any] | None]]
    ) -> dict[str, dict[str, Any]]:
        """Run `call` on every adapter concurrently; one engine's failure never hides another's."""
        adapters = list(self._adapters())
        outcomes = await asyncio.gather(*(call(a) for a in adapters), return_exceptions=True)
        report: dict[str, dict[str, Any]] = {}
        for a, out in zip(adapters, outcomes, strict=True):
            key = str(getattr(a, "base_url", repr(a)))
            if isinstance(out, BaseException):
                self.counters["engine_failures"] += 1
                self.metrics.engine_failures_total.labels(op=op).inc()
                log.warning("control %s failed on %s: %s", op, key, out)
                report[key] = {"ok": False, "error": f"{type(out).__name__}: {out}"}
            else:
                report[key] = {"ok": True, **(out or {})}
        return report

    async def _pause_engine(self, adapter: Any, mode: str) -> dict[str, Any]:
        if getattr(adapter, "protocol", None) == "sglang":
            if mode == "wait":  # SGLang has no drain mode: drain ours, then freeze
                drained = await self._drain(engine=adapter.base_url)
                await adapter.pause(_SGLANG_MODE[mode])
                return {"engine_mode": "in_place", "drained": drained}
            await adapter.pause(_SGLANG_MODE[mode])
            return {"engine_mode": _SGLANG_MODE[mode]}
        await adapter.pause(mode)
        return {"engine_mode": mode}

    async def _abort_lora_on(self, adapter: Any, lora: str) -> dict[str, Any]:
        rids = self.in_flight(engine=adapter.base_url, lora=lora)
        if rids:
            if getattr(adapter, "protocol", None) == "sglang":
                await asyncio.gather(*(adapter.abort(rid) for rid in rids))
            else:
                await adapter.abort(rids)
        return {"aborted": len(rids)}

    def _report(self, action: str, mode: str | None, lora: str | None, t0: float,
                engines: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
        failed = sorted(k for k, v in engines.items() if not v["ok"])
        report = {
            "action": action, "mode": mode, "lora": lora, "ok": not failed,
            "engines": engines, "failed": failed, "elapsed_s": time.monotonic() - t0, **extra,
        }
        self.last_report = report
        return report

    # --- pause / resume -----------------------------------------------------------------------

    async def pause(self, mode: str, lora: str | None = None) -> dict[str, Any]:
        """Close the gate (globally or for `lora`), wait the grace period, then pause engines.

        Never raises for an engine's failure: the report lists each engine's outcome."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise BadRequest(f"lora must be a non-empty string, not {lora!r}")
        async with self._lock:
            t0 = time.monotonic()
            scope = "global" if lora is None else "lora"
            pause = _Pause(mode, t0, time.time())
            if lora is None:
                self._global = pause
            else:
                self._lora[lora] = pause
            self._epoch += 1
            self._notify()
            self.counters["pauses"] += 1
            self.metrics.pauses_total.labels(scope=scope, mode=mode).inc()
            if self.grace_s > 0:
                # requests that passed the gate but are still in transit reach the engine
                await asyncio.sleep(self.grace_s)
            extra: dict[str, Any] = {}
            if lora is None:
                engines = await self._fan_out("pause", lambda a: self._pause_engine(a, mode))
            elif mode == "abort":
                engines = await self._fan_out("abort", lambda a: self._abort_lora_on(a, lora))
            else:
                engines = {}
                if mode == "wait":
                    extra["drained"] = await self._drain(lora=lora)
            return self._report("pause", mode, lora, t0, engines, **extra)

    async def resume(self, lora: str | None = None) -> dict[str, Any]:
        """Resume engines (global) and open the gate; the gate opens even if an engine failed,
        so turns are not stuck behind one engine (the report names it; resume again)."""
        async with self._lock:
            t0 = time.monotonic()
            was = self._global if lora is None else self._lora.get(lora)
            if lora is None:
                engines = await self._fan_out("resume", lambda a: a.resume())
                self._global = None
            else:
                engines = {}
                self._lora.pop(lora, None)
            self._notify()
            self.counters["resumes"] += 1
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
        self._version = version
        self.metrics.weight_version.set(version)
        if version != previous:
            for hook in list(self.on_weight_version):
                try:
                    hook(version)
                except Exception:  # a hook never blocks a weight update
                    log.exception("weight-version hook failed")
        out: dict[str, Any] = {"weight_version": version, "previous": previous, "cache_salt": self.cache_salt()}
        if previous is not None and version < previous:
            out["forced"] = True
        return out

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
        fn = getattr(adapter, "abort_request", None)
        if fn is None:
            self.metrics.engine_aborts_total.labels("unsupported").inc()
            return

        async def run() -> None:
            try:
                await asyncio.wait_for(fn(rid), self.abort_timeout_s)
                self.metrics.engine_aborts_total.labels("sent").inc()
            except Exception as exc:
                self.metrics.engine_aborts_total.labels("failed").inc()
                log.warning("abort of %s on %s failed: %r", rid, getattr(adapter, "base_url", "?"), exc)

        task = asyncio.get_running_loop().create_task(run())
        self._abort_tasks.add(task)
        task.add_done_callback(self._abort_tasks.discard)

    async def drain_aborts(self) -> None:
        """Wait for the background aborts in flight (shutdown, tests)."""
        while self._abort_tasks:
            await asyncio.gather(*list(self._abort_tasks), return_exceptions=True)

    def cache_salt(self) -> str | None:
        """Prefix-cache namespace of the current weights (vLLM `cache_salt`, SGLang `extra_key`),
        so KV computed under older weights is never reused; None when unversioned."""
        if not self.salt_cache or self._version is None:
            return None
        return f"wv-{self._version}"

    def check_reported_version(self, engine: str, reported: Any) -> bool:
        """Compare an engine-reported version with ours; a mismatch is a diagnostic, not fatal."""
        if reported is None or self._version is None or str(reported) == str(self._version):
            return True
        self.counters["version_mismatches"] += 1
        self.metrics.version_mismatch_total.inc()
        self.last_mismatch = {"engine": engine, "reported": reported, "expected": self._version,
                              "at_unix": time.time()}
        return False

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
            "lora_pauses": {
                name: {"mode": p.mode, "paused_since_unix": p.since_unix, "paused_for_s": now - p.since}
                for name, p in sorted(self._lora.items())
            },
            "weight_version": self._version,
            "cache_salt": self.cache_salt(),
            "grace_s": self.grace_s,
            "in_flight": len(self._flights),
            "waiting_at_gate": self._waiting,
            "counters": dict(self.counters),
            "last_version_mismatch": self.last_mismatch,
            "last_report": self.last_report,
        }

    # --- per-turn accounting (called by generate_resilient) -----------------------------------

    def _count_abort(self, empty: bool) -> None:
        self.counters["aborts"] += 1
        self.metrics.aborts_total.inc()
        if empty:
            self.counters["empty_aborts"] += 1
            self.metrics.empty_aborts_total.inc()

    def _count_resubmit(self) -> None:
        self.counters["resubmits"] += 1
        self.metrics.resubmits_total.inc()


async def _enter_by(stack: contextlib.AsyncExitStack, cm: contextlib.AbstractAsyncContextManager[Any],
                    deadline: float, what: str) -> None:
    """Enter `cm` on `stack`, waiting no later than the turn's monotonic `deadline`."""
    left = deadline - time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, left)):
            await stack.enter_async_context(cm)
    except TimeoutError:
        raise UpstreamTimeout(
            f"the turn's deadline passed while waiting for {what} ({max(0.0, left):.3f}s)"
        ) from None


def _as_list(v: Sequence[Any] | None) -> list[Any] | None:
    return v if v is None or isinstance(v, list) else list(v)


def _extend(prompt: TokenIds, partial: list[Any]) -> TokenIds:
    """prompt + partial, keeping a numpy prompt numpy (contexts reach 100K+ ids; no list copy)."""
    if not partial:
        return prompt
    if isinstance(prompt, np.ndarray):
        return np.concatenate([prompt, np.asarray(partial, dtype=prompt.dtype)])
    return [*prompt, *partial]


def _salted(request_salt: str | None, control_salt: str | None) -> str | None:
    if control_salt is None:
        return request_salt
    return control_salt if request_salt is None else f"{request_salt}:{control_salt}"


def _abort_on_stop_is_stop(result: GenerateResult, request: GenerateRequest,
                           expect: Expectations | None) -> GenerateResult:
    """SGLang checks the abort flag before the stop check, so a pause landing on the step
    that sampled end-of-turn reports `abort` with the stop id as the last token. That turn
    is finished: resubmitting would sample past its own end-of-turn."""
    if result.finish_reason != "abort" or not result.output_ids:
        return result
    last = result.output_ids[-1]
    stops = set(request.sampling.stop_token_ids)
    if expect is not None:
        stops |= set(expect.stop_token_ids)
    if not _is_int(last) or last not in stops:
        return result
    return replace(result, finish_reason="stop", matched_stop=last, abort_message=None)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_partial(result: GenerateResult, seg_rid: str, prompt_len: int, budget: int,
                   expect: Expectations | None, last_version: Any) -> None:
    """Reject bad raw values in an aborted segment before they are accumulated."""
    try:
        if expect is not None:
            validate_generation(result, replace(
                expect, request_id=seg_rid, prompt_len=prompt_len, max_tokens=budget,
                last_weight_version=last_version,
            ))
            return
        n = len(result.output_ids)
        if len(result.logprobs) != n:
            raise ValidationError("logprobs", f"{len(result.logprobs)} logprobs for {n} ids")
        bad = next((i for i, t in enumerate(result.output_ids) if not _is_int(t) or t < 0), None)
        if bad is not None:
            raise ValidationError("output_ids", f"{result.output_ids[bad]!r} is not a token id", bad)
        if n > budget:
            raise ValidationError("output_ids", f"{n} ids exceed max_tokens {budget}", budget)
    except ValidationError as exc:
        raise UpstreamInvalid(f"aborted segment {seg_rid} rejected: {exc}") from exc


@dataclass
class _Acc:
    """The turn so far: raw values of the segments that produced tokens."""

    ids: list[Any] = field(default_factory=list)
    lps: list[Any] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    echo: list[Any] = field(default_factory=list)
    tops_ok: bool = True  # every segment with tokens had top logprobs
    echo_ok: bool = True  # every segment with tokens had an id echo
    spans: list[list[Any]] = field(default_factory=list)

    def add(self, result: GenerateResult, version: Any) -> None:
        n = len(result.output_ids)
        if n == 0:
            return
        start = len(self.ids)
        self.ids.extend(result.output_ids)
        self.lps.extend(result.logprobs)
        if result.top_logprobs is None:
            self.tops_ok = False
        else:
            self.tops.extend(result.top_logprobs)
        if result.output_ids_echo is None:
            self.echo_ok = False
        else:
            self.echo.extend(result.output_ids_echo)
        last = self.spans[-1] if self.spans else None
        if last is not None and last[2] == version and last[1] == start:
            last[1] = start + n  # consecutive equal versions merge
        else:
            self.spans.append([start, start + n, version])


@dataclass
class _Counts:
    aborts: int = 0
    empty_aborts: int = 0
    resubmits: int = 0
    mismatches: int = 0
    dropped_tokens: int = 0  # partials of constrained segments, regenerated from the prompt
    paused_wait_s: float = 0.0
    rids: list[str] = field(default_factory=list)


async def generate_resilient(
    adapter: Any,
    request: GenerateRequest,
    control: ControlPlane,
    *,
    expect: Expectations | None = None,
    on_abort: Callable[[AbortEvent], None] | None = None,
    deadline: float | None = None,
    admit: Callable[[int | None], contextlib.AbstractAsyncContextManager[Any]] | None = None,
) -> ResilientResult:
    """Generate one turn through any number of pauses: abort -> accumulate -> resubmit.

    Each segment waits at the gate (bounded by `deadline`, monotonic; default
    now + `request.timeout_s`), is sent as `prompt + partial` with the remaining
    budget under a new fixed-width request id (the first keeps
    `request.request_id`), and carries the current weight version's cache salt.
    `expect` (the whole turn's `Expectations`) makes each aborted segment pass the
    full validator before its values are kept; without it only shapes are checked.
    `admit(uncached_guess)` (prefill admission; None = the caller's own estimate, for the
    first segment) is held per segment, never while waiting at the gate; waiting for it
    or for the adapter's `slot()` past `deadline` is `UpstreamTimeout` (504).
    Engine errors propagate; `EngineAborted` after `max_empty_aborts` consecutive
    empty aborts that no pause explains; `PausedTooLong` when paused past the deadline.
    """
    if deadline is None:
        deadline = time.monotonic() + request.timeout_s
    prompt = request.input_ids
    lora = request.lora
    engine = str(getattr(adapter, "base_url", ""))
    acc, counts = _Acc(), _Counts()
    first: GenerateResult | None = None
    last_version = None if expect is None else expect.last_weight_version
    remaining = request.max_tokens
    unexplained_empty = 0

    slot = getattr(adapter, "slot", None)
    first_salt = control.cache_salt()
    constrained = request.sampling.constraint is not None
    while True:
        async with contextlib.AsyncExitStack() as held:
            # gate -> prefill admission -> engine slot -> gate again -> read version/salt:
            # a segment queued behind admission or the engine's cap cannot slip past a
            # pause that closed meanwhile, nor carry the weight version it saw before it
            counts.paused_wait_s += await control.wait_open(lora, deadline=deadline)
            if admit is not None:
                salt_now = control.cache_salt()
                # a resubmission re-prefills only its partial, unless the salt changed
                guess = None if not counts.rids else (
                    len(prompt) + len(acc.ids) if salt_now != first_salt else len(acc.ids))
                await _enter_by(held, admit(guess), deadline, f"prefill admission on {engine}")
            if slot is not None:
                await _enter_by(held, slot(), deadline, f"a generation slot on {engine}")
            if control.blocked(lora):
                continue  # closed again while we queued: release everything, wait again
            seg_rid = request.request_id if not counts.rids else new_request_id()
            counts.rids.append(seg_rid)
            epoch, dispatch_version = control.epoch, control.weight_version
            seg_input = _extend(prompt, acc.ids)
            seg = replace(
                request,
                request_id=seg_rid,
                input_ids=seg_input,
                max_tokens=remaining,
                cache_salt=_salted(request.cache_salt, control.cache_salt()),
                timeout_s=max(0.001, deadline - time.monotonic()),
                slot_held=slot is not None,
            )
            control._enter(seg_rid, engine, lora)
            try:
                result = await adapter.generate(seg)
            except (asyncio.CancelledError, UpstreamTimeout):
                control.abort_engine_request(adapter, seg_rid)  # nobody waits for it any more
                raise
            finally:
                control._exit(seg_rid)
        if first is None:
            first = result
        if not control.check_reported_version(engine, result.weight_version):
            counts.mismatches += 1
        version = result.weight_version if result.weight_version is not None else dispatch_version
        result = _abort_on_stop_is_stop(result, request, expect)
        if result.finish_reason != "abort":
            return _assemble(request, first, result, version, acc, counts)

        _check_partial(result, seg_rid, len(seg_input), remaining, expect, last_version)
        n = len(result.output_ids)
        counts.aborts += 1
        control._count_abort(n == 0)
        if n and constrained:
            # engines restart a grammar at the first output token, so `prompt + partial`
            # under the same constraint would demand a whole new instance after the partial
            # (committing e.g. `{"a": {"a": 1}`). The partial is dropped and the turn is
            # regenerated from its own prompt with its whole budget; it was never shown.
            counts.dropped_tokens += n
            unexplained_empty = 0
        elif n:
            acc.add(result, version)
            last_version = version if version is not None else last_version
            remaining -= n
            unexplained_empty = 0
        else:  # nothing to accumulate: retry as is
            counts.empty_aborts += 1
            if control.epoch == epoch and not control.blocked(lora):
                unexplained_empty += 1
                if unexplained_empty > control.max_empty_aborts:
                    raise EngineAborted(
                        f"{request.request_id}: {unexplained_empty} consecutive aborts without a "
                        f"token or a pause: {result.abort_message or 'no message'}",
                        engine=engine,
                    )
        if on_abort is not None:
            on_abort(AbortEvent(
                request_id=request.request_id, segment_request_id=seg_rid,
                segment=len(counts.rids) - 1, new_tokens=n, total_tokens=len(acc.ids),
                remaining=remaining, paused=control.blocked(lora),
            ))
        if remaining <= 0:  # the budget ran out across aborts: the turn ends at its length
            return _assemble(request, first, None, None, acc, counts)
        counts.resubmits += 1
        control._count_resubmit()


def _assemble(
    request: GenerateRequest,
    first: GenerateResult,
    final: GenerateResult | None,
    final_version: Any,
    acc: _Acc,
    counts: _Counts,
) -> ResilientResult:
    """One GenerateResult for the whole turn. The final segment's counters stay raw
    (offset by the accumulated tokens) so the caller's validator still sees bad values."""
    before = len(acc.ids)
    single = len(counts.rids) == 1
    if final is not None:
        acc.add(final, final_version)
        ct, pt = final.completion_tokens, final.prompt_tokens
        completion = before + ct if _is_int(ct) else ct
        prompt_tokens = pt - before if _is_int(pt) else pt
        finish, matched = final.finish_reason, final.matched_stop
        weight_version = final.weight_version
        routed = final.routed_experts  # covers prompt + every partial: the last segment's is whole
        abort_message = final.abort_message
        echoed_rid = final.request_id
        raw_tops, raw_echo = final.top_logprobs, final.output_ids_echo
    else:  # budget exhausted by aborts
        completion, prompt_tokens = before, first.prompt_tokens
        finish, matched, weight_version, routed, abort_message = "length", None, None, None, None
        echoed_rid = counts.rids[-1]
        raw_tops, raw_echo = [], []
    if weight_version is None and acc.spans:
        weight_version = acc.spans[-1][2]
    if acc.ids:
        tops = acc.tops if acc.tops_ok else None
        echo = acc.echo if acc.echo_ok else None
    else:  # no token at all: keep the engine's own (empty) shapes
        tops, echo = _as_list(raw_tops), _as_list(raw_echo)
    # the turn answers to its original id, but a wrong echo of the last segment's id stays visible
    rid = request.request_id if echoed_rid == counts.rids[-1] else echoed_rid
    return ResilientResult(
        request_id=first.request_id if single else rid,
        output_ids=acc.ids,
        logprobs=acc.lps,
        finish_reason=finish,
        matched_stop=matched,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        cached_tokens=first.cached_tokens,
        weight_version=weight_version,
        output_ids_echo=echo,
        top_logprobs=tops,
        routed_experts=routed,
        abort_message=abort_message,
        weight_spans=tuple((int(s), int(e), v) for s, e, v in acc.spans),
        segments=len(counts.rids),
        segment_request_ids=tuple(counts.rids),
        aborts=counts.aborts,
        empty_aborts=counts.empty_aborts,
        resubmits=counts.resubmits,
        paused_wait_s=counts.paused_wait_s,
        version_mismatches=counts.mismatches,
        dropped_tokens=counts.dropped_tokens,
    )
