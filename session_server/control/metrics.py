"""The control plane's Prometheus metrics: the one source of its counters.

`GET /control/state` reads its `counters` from these same metrics (`totals`), so the
state view and `/metrics` can never disagree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["ControlMetrics"]

_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


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
        self.turns_ended_stale_total = Counter(
            "tito_turns_ended_stale_total",
            "Turns ended at a weight update by their staleness bound (max_weight_lag)", registry=r,
        )
        self.paused_too_long_total = Counter(
            "tito_turn_paused_too_long_total", "Turns whose deadline passed while paused", registry=r
        )
        self.engine_aborts_total = Counter(
            "tito_engine_aborts_sent_total",
            "Engine requests aborted because their turn stopped waiting (cancel, timeout) "
            "or reached its staleness bound at a weight update, by outcome",
            ["outcome"], registry=r,
        )
        self.paused_wait_seconds = Histogram(
            "tito_turn_paused_wait_seconds", "Time a turn segment waited at the closed pause gate",
            buckets=_WAIT_BUCKETS_S, registry=r,
        )


    def totals(self) -> dict[str, float]:
        """The per-server counters `GET /control/state` shows (summed over labels)."""
        return {
            "pauses": int(_sum(self.pauses_total, "_total")),
            "resumes": int(_sum(self.resumes_total, "_total")),
            "aborts": int(_sum(self.aborts_total, "_total")),
            "empty_aborts": int(_sum(self.empty_aborts_total, "_total")),
            "resubmits": int(_sum(self.resubmits_total, "_total")),
            "paused_wait_s": _sum(self.paused_wait_seconds, "_sum"),
            "paused_too_long": int(_sum(self.paused_too_long_total, "_total")),
            "turns_ended_stale": int(_sum(self.turns_ended_stale_total, "_total")),
            "version_mismatches": int(_sum(self.version_mismatch_total, "_total")),
            "engine_failures": int(_sum(self.engine_failures_total, "_total")),
        }


def _sum(metric: MetricWrapperBase, suffix: str) -> float:
    """Sum of `metric`'s samples named `*suffix` across all its label values."""
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith(suffix))
