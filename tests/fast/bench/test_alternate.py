"""`bench/alternate.py`: the ABBA order of old and new runs, and the dotted-key
medians and ratio it reports."""

from __future__ import annotations

import pytest

from bench.alternate import _split_argv, abba_order, lookup, summarize


def test_abba_order_gives_each_side_the_same_early_and_late_slots() -> None:
    assert abba_order(1) == ["old", "new"]
    assert abba_order(3) == ["old", "new", "new", "old", "old", "new"]
    order = abba_order(4)
    assert order.count("old") == order.count("new") == 4
    # a steady drift cancels: the slots of each side sum to the same
    assert sum(i for i, s in enumerate(order) if s == "old") == sum(i for i, s in enumerate(order) if s == "new")


def test_lookup_follows_dotted_paths_and_list_indices() -> None:
    data = {"health_ms": {"p99": 12.5}, "levels": [{"p99_s": 1}, {"p99_s": 2.5}], "ok": True}
    assert lookup(data, "health_ms.p99") == 12.5
    assert lookup(data, "levels.0.p99_s") == 1.0
    assert lookup(data, "levels.-1.p99_s") == 2.5
    assert lookup(data, "levels.2.p99_s") is None
    assert lookup(data, "health_ms.p50") is None
    assert lookup(data, "ok") is None  # a bool is not a measurement
    assert lookup(data, "health_ms") is None


def test_summarize_takes_each_sides_median_and_the_new_over_old_ratio() -> None:
    old = [{"x": {"y": 4.0}}, {"x": {"y": 6.0}}, {"x": {"y": 5.0}}]
    new = [{"x": {"y": 2.0}}, {"x": {}}, {"x": {"y": 3.0}}]
    s = summarize(old, new, ["x.y"])["x.y"]
    assert s["old_median"] == 5.0
    assert s["new_median"] == 2.5  # over the runs that have the key
    assert s["new_values"] == [2.0, None, 3.0]
    assert s["new_over_old"] == pytest.approx(0.5)
    assert summarize(old, new, ["nope"])["nope"]["new_over_old"] is None


def test_the_bench_command_is_what_follows_the_double_dash() -> None:
    assert _split_argv(["--old", "a", "--", "bench/x.py", "--runs", "1"]) == (
        ["--old", "a"], ["bench/x.py", "--runs", "1"])
    with pytest.raises(SystemExit):
        _split_argv(["--old", "a", "bench/x.py"])
