"""Prometheus metrics of one server process (own registry, so tests can build many apps)."""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PHASES = ("claim", "parse", "prepare", "render", "route", "generate", "validate", "commit", "respond", "total")
_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_GC_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class PhaseSeconds(Collector):
    """`tito_turn_phase_seconds`, a histogram by phase observed about ten times per
    turn: plain counts per bucket, with no lock taken and no sample objects built per
    observation (prometheus_client's Histogram takes one lock per bucket and sum).
    Observed on the event loop only; read at a scrape."""

    name = "tito_turn_phase_seconds"

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._bounds = list(buckets)
        self._les = [floatToGoString(b) for b in buckets] + ["+Inf"]
        # per phase: [sum, created, one count per bucket, then +Inf], one list so that a
        # scrape never sees a phase half made
        self._phases: dict[str, list[Any]] = {}

    def observe(self, phase: str, seconds: float) -> None:
        row = self._phases.get(phase)
        if row is None:
            row = self._phases[phase] = [0.0, time.time()] + [0] * (len(self._bounds) + 1)
        row[0] += seconds
        if seconds == seconds:  # as prometheus_client: a NaN adds to the sum, to no bucket
            row[2 + bisect_left(self._bounds, seconds)] += 1  # the first bucket with seconds <= le

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, "Turn latency by pipeline phase", labels=["phase"])
        for phase, row in list(self._phases.items()):
            cumulative = list(accumulate(row[2:]))
            family.add_metric([phase], list(zip(self._les, cumulative, strict=True)), row[0])
            family.add_sample(f"{self.name}_created", {"phase": phase}, row[1])
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, "Turn latency by pipeline phase", labels=["phase"])


class GcPauses(Collector):
    """`tito_gc_pause_seconds`, a histogram by generation of the cyclic GC's passes in
    this process: each pass stops every thread, the event loop's included, and a full
    pass scans every tracked object of every live session (bench/gc_pauses.py). Timed
    by a `gc.callbacks` hook with plain counts (no lock: a pass runs inside whatever
    allocation triggered it, possibly inside a locked metric update); read at a scrape."""

    name = "tito_gc_pause_seconds"
    help = "Cyclic garbage collector passes by generation: how long each stopped the process"

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self._bounds = list(buckets)
        self._les = [floatToGoString(b) for b in buckets] + ["+Inf"]
        self._rows = [[0.0] + [0] * (len(buckets) + 1) for _ in range(3)]  # per generation: sum, buckets
        self._started: float | None = None  # perf_counter at the running pass's start

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        started, self._started = self._started, None
        if started is None:  # installed while a pass ran: its start was not seen
            return
        row = self._rows[min(info["generation"], 2)]
        seconds = now - started
        row[0] += seconds
        row[1 + bisect_left(self._bounds, seconds)] += 1

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.help, labels=["generation"])
        for generation, row in enumerate(self._rows):
            family.add_metric([str(generation)], list(zip(self._les, accumulate(row[1:]), strict=True)), row[0])
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.help, labels=["generation"])


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.turn_phase_seconds = PhaseSeconds(_LATENCY_BUCKETS_S)
        r.register(self.turn_phase_seconds)
        self.gc_pauses = GcPauses(_GC_BUCKETS_S)  # installed while the server runs (lifecycle)
        r.register(self.gc_pauses)
        self.turns_in_flight = Gauge("tito_turns_in_flight", "Chat turns currently in flight", registry=r)
        self.turns_total = Counter("tito_turns_total", "Completed turns by outcome", ["outcome"], registry=r)
        self.errors_total = Counter("tito_errors_total", "Errors answered, by error type", ["type"], registry=r)
        self.tokens_in_total = Counter("tito_prompt_tokens_total", "New prompt tokens appended", registry=r)
        self.tokens_out_total = Counter("tito_sampled_tokens_total", "Sampled tokens committed", registry=r)
        self.cached_tokens_total = Counter("tito_cached_tokens_total", "Prompt tokens the engine reported cached", registry=r)
        self.sessions_active = Gauge("tito_sessions", "Sessions in the store", registry=r)
        self.sessions_expired_total = Counter("tito_sessions_expired_total", "Sessions removed by TTL", registry=r)
        self.replays_total = Counter(
            "tito_replays_total", "Replayed requests (SDK retries) answered without a new turn, by where the "
            "response came from: in_flight (waited for the original), stored, or failed (the original committed, "
            "then its response failed: the same error again)", ["source"], registry=r,
        )
        self.replay_store_bytes = Gauge("tito_replay_store_bytes", "Bytes of stored responses kept for replays",
                                        registry=r)
        self.replays_evicted_total = Counter("tito_replays_evicted_total", "Stored responses evicted (per-session "
                                             "count or the byte budget)", registry=r)
        self.stream_tool_divergence_total = Counter(
            "tito_stream_tool_divergence_total", "Live-streamed turns whose final parse disagrees with the tool "
            "calls streamed (committed as parsed: the tokens are the truth)", registry=r,
        )
        self.stream_overflows_total = Counter(
            "tito_stream_overflows_total", "Streamed responses cut because their client stopped reading (its "
            "unsent frames passed stream_buffer_bytes); the turns still committed", registry=r,
        )
        self.branches_total = Counter("tito_branches_total", "Branches created, by reason", ["reason"], registry=r)
        self.loop_lag_seconds = Histogram(
            "tito_event_loop_lag_seconds", "How late the event loop ran a timer (lifecycle.loop_lag_probe): "
            "what every request on this process waited on top of its own work", buckets=_LAG_BUCKETS_S, registry=r,
        )

    def observe_phase(self, phase: str, seconds: float) -> None:
        self.turn_phase_seconds.observe(phase, seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
