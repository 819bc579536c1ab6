"""Routing simulation: the server's policy objects driving a discrete-event cluster.

The entry point: runs every policy on one scenario
and writes the report. The pieces, one job each:

- `routing_workload.py`: scenarios (`SimConfig`) and the scripted sessions of an
  RL batch (start together, grow from a few K to ~100K tokens through model and
  tool output, a tool latency between turns).
- `routing_model.py`: the cost model and the engine model. Each rank has a prefix
  (radix) cache of finite token capacity, LRU over sessions; a FIFO queue of
  prefills (chunked, `chunk_tokens` per iteration) and a decode batch. The ranks
  of one engine step in lock-step: an iteration lasts alpha + beta * prefill
  tokens + gamma * decode batch of the *slowest* rank, so one rank's long prefill
  slows every rank's decode. `calibrate`: one rank prefilling 41K tokens takes
  ~35 s while the other ranks' decode falls from ~68 to 3-8 tok/s; measured, not
  assumed.
- `routing_cluster.py`: the "server": every turn calls
  `policy.select(RoutingSignals(...))` on views of the ranks (the same objects
  `EnginePool` uses); a request has a 600 s deadline from dispatch; a timed-out
  turn aborts its session (a lost rollout); a turn on an engine that dies is
  retried once on the policy's new choice.
- `routing_report.py`: per-policy metrics, the markdown table, PNG and README
  section.

    python bench/routing_sim.py --scenario storm --quick --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.routing_cluster import Cluster  # noqa: E402
from bench.routing_model import calibrate  # noqa: E402
from bench.routing_report import markdown_table, metrics, update_readme, write_png  # noqa: E402
from bench.routing_workload import (  # noqa: E402
    SCENARIOS,
    SimConfig,
    TurnScript,
    add_scenario_args,
    make_sessions,
    quick,
    scenario_from_args,
)
from session_server.routing import POLICY_NAMES, make_policy  # noqa: E402

__all__ = ["REPORT_POLICIES", "SCENARIOS", "calibrate", "main", "quick", "run_policy",
           "simulate", "update_readme"]

REPORT_POLICIES = POLICY_NAMES


def run_policy(name: str, cfg: SimConfig, scripts: list[list[TurnScript]]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if name == "sticky_cost":
        overrides["prefill_tokens_per_s"] = cfg.cost.prefill_tokens_per_s()
    t0 = time.perf_counter()
    cluster = Cluster(cfg, make_policy(name, **overrides), scripts)
    cluster.run()
    out = metrics(cluster)
    out["wall_s"] = time.perf_counter() - t0
    return out


def simulate(cfg: SimConfig, policies: tuple[str, ...] = REPORT_POLICIES) -> dict[str, Any]:
    scripts = make_sessions(cfg)
    return {
        "config": asdict(cfg),
        "calibration": calibrate(cfg.cost),
        "turns_scripted": sum(len(s) for s in scripts),
        "policies": {name: run_policy(name, cfg, scripts) for name in policies},
    }



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_scenario_args(ap)
    ap.add_argument("--policies", default=",".join(REPORT_POLICIES))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--readme", type=Path, default=None, help="update this README's section")
    args = ap.parse_args(argv)
    cfg = scenario_from_args(args)
    t0 = time.perf_counter()
    result = simulate(cfg, tuple(p for p in args.policies.split(",") if p))
    result["scenario"] = args.scenario
    result["quick"] = args.quick
    cal = result["calibration"]
    print(
        f"calibration: {cal['prefill_tokens']} tokens prefill {cal['prefill_s']:.1f} s; other ranks decode "
        f"{cal['decode_tok_s_idle']:.0f} -> {cal['decode_tok_s_during_prefill']:.1f} tok/s"
    )
    print(markdown_table(result))
    print(f"wall {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        write_png(result, args.png, f"routing simulation: {args.scenario}")
    if args.readme:
        shape = (
            f"{cfg.engines} engines x {cfg.dp_ranks} DP ranks, {cfg.sessions} sessions "
            f"({cfg.initial_tokens[0] // 1000}-{cfg.initial_tokens[1] // 1000}K -> "
            f"{cfg.final_tokens[0] // 1000}-{cfg.final_tokens[1] // 1000}K tokens, "
            f"{result['turns_scripted']} turns), KV {cfg.kv_capacity_tokens:,} tokens/rank, "
            f"timeout {cfg.timeout_s:.0f} s"
        )
        if cfg.death_engine is not None:
            shape += f"; engine e{cfg.death_engine} dies at {cfg.death_at_s:.0f} s"
            if cfg.recover_at_s is not None:
                shape += f", recovers at {cfg.recover_at_s:.0f} s"
        body = (
            f"{shape}{' (--quick)' if args.quick else ''}. Calibration measured on the model: "
            f"{cal['prefill_tokens']:,}-token prefill {cal['prefill_s']:.1f} s, other ranks' decode "
            f"{cal['decode_tok_s_idle']:.0f} -> {cal['decode_tok_s_during_prefill']:.1f} tok/s.\n\n"
            + markdown_table(result)
        )
        update_readme(args.readme, args.scenario, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
