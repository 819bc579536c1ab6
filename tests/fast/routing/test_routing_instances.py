"""The routing simulator with N independent instances over the same engines."""

from __future__ import annotations

from dataclasses import replace

from bench.routing_instances import InstancesCluster, compare
from bench.routing_workload import SCENARIOS, SimConfig, make_sessions, quick
from session_server.routing import make_policy


def _small() -> SimConfig:
    return replace(quick(SCENARIOS["storm"]), sessions=32, final_tokens=(20_000, 30_000))


def test_n_instances_keep_hit_rate_and_lose_nothing() -> None:
    result = compare(_small(), "sticky_cost", 4, 2.0)
    runs = list(result["runs"].values())
    assert [r["instances"] for r in runs] == [1, 4, 4] and [r["poll_s"] for r in runs] == [None, None, 2.0]
    one = runs[0]
    for r in runs:
        assert r["timeouts"] == 0 and r["lost_turns"] == 0
        assert r["hit_rate"] >= one["hit_rate"] - 0.01
        assert r["completed_turns"] == one["completed_turns"]


def test_each_instance_sees_only_its_own_work_plus_the_polled_rest() -> None:
    cfg = _small()
    scripts = make_sessions(cfg)
    cl = InstancesCluster(cfg, [make_policy("sticky_least_loaded") for _ in range(2)], scripts, poll_s=0.0)
    cl.dispatch(0, 1)  # instance 0 places session 0
    cl._inst = 1
    views = {v.id: v for v in cl.views()}
    home = cl.home[0]
    assert views[home].in_flight == 0 and views[home].external_load == 1  # instance 0's turn, learned
    blind = InstancesCluster(cfg, [make_policy("sticky_least_loaded") for _ in range(2)], scripts, poll_s=None)
    blind.dispatch(0, 1)
    blind._inst = 1
    assert all(v.external_load == 0 and v.in_flight == 0 for v in blind.views())
