"""The routing simulator, small: the storm ordering and engine death, computed by the model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.routing_sim import SCENARIOS, calibrate, quick, simulate, update_readme


def test_calibration_matches_the_reported_storm() -> None:
    cal = calibrate(SCENARIOS["storm"].cost)
    assert 30.0 <= cal["prefill_s"] <= 40.0
    assert 60.0 <= cal["decode_tok_s_idle"] <= 75.0
    assert 3.0 <= cal["decode_tok_s_during_prefill"] <= 8.0


def test_storm_ordering() -> None:
    cfg = quick(SCENARIOS["storm"])
    pol = simulate(cfg, ("round_robin", "sticky_cost"))["policies"]
    rr, sc = pol["round_robin"], pol["sticky_cost"]
    assert rr["timeouts"] > 0
    assert sc["timeouts"] == 0 and sc["lost_turns"] == 0
    assert sc["hit_rate"] >= 0.95 * sc["ideal_hit_rate"]
    assert sc["turn_latency_p99_s"] <= 0.5 * rr["turn_latency_p99_s"]
    assert sc["reprefill_tokens"] < rr["reprefill_tokens"] / 100


def test_engine_death_loses_no_turn_with_sticky_cost() -> None:
    cfg = replace(quick(SCENARIOS["engine_death"]), sessions=48)
    sc = simulate(cfg, ("sticky_cost",))["policies"]["sticky_cost"]
    assert sc["lost_turns"] == 0 and sc["timeouts"] == 0
    assert sc["retries"] > 0 and sc["rehomes"] > 0


def test_readme_section_update_keeps_other_sections(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("# Benchmarks\n\n## Other\n\nkeep me\n")
    update_readme(path, "storm", "table one")
    update_readme(path, "engine_death", "table two")
    update_readme(path, "storm", "table three")
    text = path.read_text()
    assert "keep me" in text and "table one" not in text
    assert text.index("## Other") < text.index("## Routing simulation")
    assert text.count("### storm") == 1 and "table three" in text and "table two" in text
