"""Routing simulation with N independent server instances over the same engines.

The cluster of `routing_sim.py` (same engines, workload and cost model), but the
sessions are spread over N server instances (session i on instance i mod N, as a
proxy's least-connections spreads a batch that starts together). Each instance has its
own policy object and sees only its own bookkeeping: its in-flight turns, pending
prefills, homed sessions and the tokens it believes cached; nothing is shared between
instances. With engine-load learning (`--poll-s`, the server's `engine_load_poll_s`)
an instance also knows, per rank, the requests the engine reported at its last poll
beyond its own (`TargetView.external_load`), refreshed at most every `poll_s`
(at the instance's first decision after the period: the staleness a poll gives).

    python bench/routing_instances.py --quick --json bench/results/routing_instances.json --readme bench/README.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.routing_cluster import Cluster  # noqa: E402
from bench.routing_model import Rank  # noqa: E402
from bench.routing_report import COLUMNS, markdown_table, metrics, update_readme  # noqa: E402
from bench.routing_workload import (  # noqa: E402
    SimConfig,
    TurnScript,
    add_scenario_args,
    make_sessions,
    scenario_from_args,
)
from session_server.routing import RoutingPolicy, TargetView, make_policy  # noqa: E402

__all__ = ["InstancesCluster", "compare", "main", "run_instances"]


class InstancesCluster(Cluster):
    """`Cluster` with N instances: each decision is made by the session's instance on
    that instance's own view of the ranks (plus engine-reported load when polled)."""

    def __init__(
        self, cfg: SimConfig, policies: list[RoutingPolicy], scripts: list[list[TurnScript]],
        *, poll_s: float | None = None,
    ) -> None:
        super().__init__(cfg, policies[0], scripts)
        self.policies = policies
        self.n = len(policies)
        self.poll_s = poll_s
        self._inst = 0
        self._external: list[dict[str, int]] = [{} for _ in policies]
        self._polled_at = [-math.inf] * self.n

    def dispatch(self, sid: int, attempt: int) -> None:
        self._inst = sid % self.n
        self.policy = self.policies[self._inst]
        super().dispatch(sid, attempt)

    def _own_jobs(self, r: Rank, i: int) -> int:
        return sum(1 for j in (*r.queue, *r.batch) if j.session % self.n == i)

    def _poll(self, i: int) -> None:
        """What instance i learns from the engines: per rank, requests beyond its own."""
        self._external[i] = {
            r.id: len(r.queue) + len(r.batch) - self._own_jobs(r, i) for r in self.ranks
        }
        self._polled_at[i] = self.now

    def views(self) -> list[TargetView]:
        i = self._inst
        if self.poll_s is not None and self.now - self._polled_at[i] >= self.poll_s:
            self._poll(i)
        ext = self._external[i]
        return [
            TargetView(
                id=r.id,
                healthy=r.engine.healthy,
                in_flight=self._own_jobs(r, i),
                sessions=sum(1 for s in r.homes if s % self.n == i),
                resident_tokens=sum(self.context[s] for s in r.homes if s % self.n == i),
                pending_prefill_tokens=sum(j.prefill_left for j in r.queue if j.session % self.n == i),
                kv_capacity_tokens=r.capacity,
                engine_id=f"e{r.engine.index}",
                external_load=max(0, ext.get(r.id, 0)),
            )
            for r in self.ranks
        ]


def run_instances(
    cfg: SimConfig, scripts: list[list[TurnScript]], policy: str, n: int, poll_s: float | None
) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if policy == "sticky_cost":
        overrides["prefill_tokens_per_s"] = cfg.cost.prefill_tokens_per_s()
    t0 = time.perf_counter()
    cluster = InstancesCluster(cfg, [make_policy(policy, **overrides) for _ in range(n)], scripts, poll_s=poll_s)
    cluster.run()
    out = metrics(cluster)
    out.update(instances=n, poll_s=poll_s, wall_s=time.perf_counter() - t0)
    return out


def compare(cfg: SimConfig, policy: str = "sticky_cost", n: int = 4, poll_s: float = 2.0) -> dict[str, Any]:
    """N=1 against N=n without and with engine-load learning, on the same scripted sessions."""
    scripts = make_sessions(cfg)
    runs = {
        "1 instance": run_instances(cfg, scripts, policy, 1, None),
        f"{n} instances, no load learning": run_instances(cfg, scripts, policy, n, None),
        f"{n} instances, engine load every {poll_s:g} s": run_instances(cfg, scripts, policy, n, poll_s),
    }
    return {"config": asdict(cfg), "policy": policy, "turns_scripted": sum(len(s) for s in scripts), "runs": runs}


SHOWN = ("timeouts", "lost_turns", "hit_rate", "ttft_p99_s", "turn_latency_p50_s", "turn_latency_p99_s",
         "makespan_s", "load_imbalance")


def table(result: dict[str, Any]) -> str:
    return markdown_table({"policies": result["runs"]}, columns=tuple(c for c in COLUMNS if c[0] in SHOWN),
                          label="run")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scenario_args(ap)
    ap.add_argument("--policy", default="sticky_cost")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--poll-s", type=float, default=2.0, help="engine-load poll period of the learning run")
    ap.add_argument("--jitter-s", type=float, default=None, help="sessions start over this many seconds")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--readme", type=Path, default=None, help="update this README's section")
    args = ap.parse_args(argv)
    cfg = scenario_from_args(args)
    if args.jitter_s is not None:
        cfg = replace(cfg, start_jitter_s=args.jitter_s)
    result = compare(cfg, args.policy, args.instances, args.poll_s)
    result.update(scenario=args.scenario, quick=args.quick)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.readme:
        shape = (f"{cfg.engines} engines x {cfg.dp_ranks} DP ranks, {cfg.sessions} sessions "
                 f"({result['turns_scripted']} turns) starting within {cfg.start_jitter_s:g} s, policy "
                 f"`{args.policy}`, timeout {cfg.timeout_s:.0f} s")
        title = f"{args.scenario}, {args.instances} instances" + (
            f", arrivals over {args.jitter_s:g} s" if args.jitter_s is not None else "")
        update_readme(args.readme, title,
                      f"{shape}{' (--quick)' if args.quick else ''}.\n\n{table(result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
