"""The turn phase histogram reads as prometheus_client's own Histogram would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from session_server.metrics import _LATENCY_BUCKETS_S, Metrics


def _lines(text: bytes, name: str) -> set[str]:
    """The histogram's lines, `_created` values (when each phase was first observed) cut."""
    return {line.rsplit(" ", 1)[0] if line.startswith(f"{name}_created") else line
            for line in text.decode().splitlines() if name in line}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["parse", "render", "total"]),
                          st.one_of(st.sampled_from(_LATENCY_BUCKETS_S), st.floats(0, 1000), st.just(float("nan")))), max_size=40))
def test_phase_seconds_exposes_what_a_prometheus_histogram_would(observations: list[tuple[str, float]]) -> None:
    metrics = Metrics()
    registry = CollectorRegistry()
    reference = Histogram("tito_turn_phase_seconds", "Turn latency by pipeline phase", ["phase"],
                          buckets=_LATENCY_BUCKETS_S, registry=registry)
    for phase, seconds in observations:
        metrics.observe_phase(phase, seconds)
        reference.labels(phase=phase).observe(seconds)
    name = "tito_turn_phase_seconds"
    assert _lines(metrics.render(), name) == _lines(generate_latest(registry), name)
