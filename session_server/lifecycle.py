"""The server's lifecycle: build the shared context, run its background tasks, shut down.

`create_app`'s lifespan calls `build_context` (CPU offload threads, tokenizer and codec,
reply decoder, engine registry and routing pool, control plane, session store),
`start_background` (TTL sweeper, engine health checks), `join_cluster` (with peers: read
the cluster's control state before serving turns) and, at exit, `shutdown` (stop
background work, drain in-flight turns within `drain_timeout_s`, close engines).
`engine_url` is how the routes read an engine address without reaching into engines/.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from transformers import AutoTokenizer

from trajectory.codec import codec_for, resolve_family

from .context import ServerContext, log
from .control import ControlPlane
from .control.peer_sync import sync_from_peers
from .control.relay import PeerRelay
from .durability import open_journal
from .engines.registry import EngineRegistry
from .engines.reply_decoder import ReplyDecoder
from .metrics import Metrics
from .model_config import model_routed_shape, model_vocab_size
from .offload import CpuOffload
from .routing import AdmissionConfig, PrefillAdmission, health_check_loop, make_policy
from .routing.pool import EnginePool
from .sessions import SessionStore
from .settings import Settings
from .tracing import Tracing

__all__ = ["AppConfig", "Background", "build_context", "join_cluster", "open_relay", "open_tracing", "shutdown",
           "start_background"]


@dataclass
class AppConfig:
    """What `serve` (or a test) decides before the app starts."""

    tokenizer: str | Any  # path/name for AutoTokenizer.from_pretrained, or a tokenizer object
    engines: Sequence[str] = ()  # "URL", "sglang=URL" or "vllm=URL"
    settings: Settings = field(default_factory=Settings)
    family: str | None = None  # force a codec family (over settings.template_family) instead of detecting it
    # an OpenTelemetry SpanExporter (tests, embedding): traces on, each span exported as it ends
    span_exporter: Any = None


async def build_context(config: AppConfig) -> ServerContext:
    """Everything a route and the turn pipeline share, built once at start-up."""
    settings = config.settings
    tracing = open_tracing(config)  # first: missing OpenTelemetry packages stop the start at once
    offload = CpuOffload(settings.cpu_workers)
    tok = config.tokenizer
    if isinstance(tok, str):
        tok = await offload.run(AutoTokenizer.from_pretrained, tok)
    detection = await offload.run(resolve_family, tok, config.family or settings.template_family)
    log.info("chat-template family: %s", detection.describe())
    codec = await offload.run(codec_for, tok, detection)
    vocab_size = await offload.run(model_vocab_size, tok, settings.vocab_size)
    if vocab_size != len(tok):
        log.info("model vocabulary: %d rows for %d tokenizer ids", vocab_size, len(tok))
    model_routed = await offload.run(model_routed_shape, str(getattr(tok, "name_or_path", "") or ""))
    decoder = ReplyDecoder(offload, processes=settings.decode_processes, malloc_retain_mb=settings.malloc_retain_mb)
    engines = EnginePool(make_policy(settings.routing_policy))
    registry = EngineRegistry(engines, offload=decoder.run, remote=decoder if decoder.processes else None,
                              sglang_incremental=settings.sglang_incremental_streams)
    for spec in config.engines:
        await registry.add(spec)
    metrics = Metrics()
    control = ControlPlane(
        registry,
        metrics_registry=metrics.registry,
        grace_s=settings.pause_grace_s,
        drain_timeout_s=settings.pause_drain_timeout_s,
    )
    control.on_weight_version.append(lambda _v: engines.reset_cached())  # new salt: nothing cached
    ctx = ServerContext(
        settings=settings,
        store=SessionStore(max_sessions=settings.max_sessions, default_ttl_s=settings.default_ttl_s,
                           instance_id=settings.instance_id, clustered=bool(settings.peers)),
        offload=offload,
        metrics=metrics,
        codec=codec,
        tokenizer=tok,
        vocab_size=vocab_size,
        pool=engines,
        registry=registry,
        decoder=decoder,
        control=control,
        admission=PrefillAdmission(
            AdmissionConfig(settings.prefill_slots_per_engine, settings.large_prefill_tokens)
        ),
        model_routed=model_routed,
        journal=open_journal(settings),
        tracing=tracing,
    )
    ctx.store.recovering = ctx.journal is not None  # durability.recover opens the store
    ctx.store.on_remove.append(lambda s: engines.forget(s.id, s.home))  # DELETE and TTL alike
    await decoder.start()  # last: a start that fails above leaves no worker behind
    return ctx


def open_tracing(config: AppConfig) -> Tracing | None:
    """The tracer when traces are on (an endpoint or an exporter), else None: the
    OpenTelemetry packages are imported only then (`TracingUnavailable` when missing)."""
    settings = config.settings
    if settings.otel_endpoint is None and config.span_exporter is None:
        return None
    return Tracing.open(endpoint=settings.otel_endpoint, service_name=settings.otel_service_name,
                        instance_id=settings.instance_id, exporter=config.span_exporter)


@dataclass
class Background:
    """The server's own tasks, stopped first at shutdown."""

    tasks: list[asyncio.Task[None]]
    stop_health_checks: asyncio.Event


def start_background(ctx: ServerContext) -> Background:
    """Start the TTL sweeper and the engine health checks; freeze start-up objects."""
    settings, engines, registry = ctx.settings, ctx.pool, ctx.registry
    sweeper = asyncio.create_task(sweep(ctx), name="tito-ttl-sweeper")
    stop_health_checks = asyncio.Event()
    checker = asyncio.create_task(
        health_check_loop(engines, registry.check_health, settings.health_check_interval_s, 5.0, stop_health_checks),
        name="tito-health-checks",
    )
    tasks = [sweeper, checker]
    if settings.loop_lag_probe_s > 0:
        tasks.append(asyncio.create_task(loop_lag_probe(ctx.metrics, settings.loop_lag_probe_s), name="tito-loop-lag"))
    if settings.engine_load_poll_s > 0:  # other instances' load on shared engines
        tasks.append(asyncio.create_task(registry.poll_loads(settings.engine_load_poll_s), name="tito-load-polls"))
    gc.collect()
    gc.freeze()  # start-up objects (tokenizer, codec, templates) never need scanning again
    ctx.metrics.gc_pauses.install()
    log.info("session server ready: family=%s engines=%d", getattr(ctx.codec, "family", "?"), len(engines.engines))
    return Background(tasks, stop_health_checks)


def open_relay(settings: Settings) -> PeerRelay:
    """This instance's client to its peers (none: a relay that relays nothing)."""
    return PeerRelay(settings.peers, timeout_s=settings.peer_timeout_s, admin_token=settings.admin_token)


def join_cluster(ctx: ServerContext, relay: PeerRelay, background: Background) -> None:
    """With peers, close the turn gate until the cluster's control state (pause, weight
    version, engines) was read from them (control/peer_sync.py): a starting instance
    must not serve turns the cluster has paused. The read runs as a background task."""
    if ctx.settings.peers:
        ctx.control.begin_sync()
        background.tasks.append(asyncio.create_task(_sync(relay, ctx), name="tito-peer-sync"))


async def _sync(relay: PeerRelay, ctx: ServerContext) -> None:
    """The peer sync of a starting instance, logged; its gate opens whatever happens."""
    try:
        outcome = await sync_from_peers(relay, ctx.control, ctx.registry, drain_s=ctx.settings.turn_timeout_s)
    except Exception:  # its `finally` opened the gate: serve as a lone instance would
        log.exception("peer sync failed; serving with this instance's own state")
        return
    if outcome.adopted_from:
        log.info("joined the cluster: %s", orjson.dumps(outcome.as_dict()).decode())
    else:  # the first worker of a cluster to come up: expected, one line
        why = unanswered_summary(outcome.unanswered)
        log.info("no peer answered%s: serving with this instance's own state", f" ({why})" if why else "")


PEERS_NAMED = 3  # unanswered peers a start-up line names; the rest are counted
_ENTRY_CHARS = 96  # one peer and its reason, at most


def unanswered_summary(unanswered: Mapping[str, str]) -> str:
    """The peers that did not answer, as one short line whatever the cluster's size: the
    first `PEERS_NAMED` with their reasons, then "and N more" (a 9-worker cluster's first
    worker would otherwise log eight peers on one line, past what a log line should be)."""
    entries = [f"{peer} {reason}" for peer, reason in unanswered.items()]
    named = [e if len(e) <= _ENTRY_CHARS else e[: _ENTRY_CHARS - 3] + "..." for e in entries[:PEERS_NAMED]]
    more = len(entries) - len(named)
    return "; ".join(named) + (f"; and {more} more" if more else "")


async def loop_lag_probe(metrics: Metrics, interval_s: float) -> None:
    """Every `interval_s`, how much later than asked a timer fired: the time the loop
    spent on other callbacks (or blocked) that every request here waited for too. The
    operator's view of "nothing blocks the event loop" (bench/_loopwatch.py is the
    bench's); a few wake-ups a second cost nothing."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(interval_s)
        metrics.loop_lag_seconds.observe(max(0.0, loop.time() - t0 - interval_s))


SWEEP_BATCH = 512  # heap entries per step of a sweep: ~3 ms of removals (bench/stall_timings.py)


async def sweep(ctx: ServerContext) -> None:
    """Background TTL expiry; never touches a session with a chat in flight.

    Each step handles at most `SWEEP_BATCH` due entries and yields, so a mass
    expiry (100K sessions made at once) is spread over many short steps."""
    while True:
        await asyncio.sleep(ctx.settings.sweep_interval_s)
        while True:
            expired = ctx.store.expire(limit=SWEEP_BATCH)
            for sid in expired:
                ctx.metrics.sessions_expired_total.inc()
                log.info("session %s expired", sid)
            if not ctx.store.expiry_due():
                break
            await asyncio.sleep(0)


async def shutdown(ctx: ServerContext, background: Background) -> None:
    """1. stop background tasks; 2. wait for in-flight turns (bounded); 3. close the journal; 4. close
    engines; 5. stop the CPU offload threads."""
    background.stop_health_checks.set()
    ctx.metrics.gc_pauses.uninstall()
    for task in background.tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    deadline = time.monotonic() + ctx.settings.drain_timeout_s
    while time.monotonic() < deadline:
        busy = sum(1 for s in ctx.store.all().values() if s.inflight is not None)
        if busy == 0:
            break
        await asyncio.sleep(0.05)
    else:
        busy = sum(1 for s in ctx.store.all().values() if s.inflight is not None)
        log.warning("shutdown: %d turns still in flight after %.1fs drain", busy, ctx.settings.drain_timeout_s)
    if ctx.journal is not None:  # what the drained turns committed is written before the exit
        await ctx.journal.close()
        ctx.journal.release()
    await ctx.registry.aclose()
    if ctx.tracing is not None:  # the batched spans go out (the SDK bounds the wait)
        await asyncio.to_thread(ctx.tracing.shutdown)
    await ctx.decoder.aclose()
    ctx.offload.shutdown()
