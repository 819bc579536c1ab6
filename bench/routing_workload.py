"""Routing simulation, the workload: scenarios and the scripted sessions of an RL batch.

Sessions start together (an RL batch boundary), grow from a few K to ~100K tokens
through model output (cached where it was generated) and tool output (new prompt
tokens each turn), with a tool latency between turns.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field, replace

from bench.routing_model import CostModel

__all__ = ["SCENARIOS", "SimConfig", "TurnScript", "add_scenario_args", "make_sessions", "quick", "scenario_from_args"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    engines: int = 2
    dp_ranks: int = 4
    sessions: int = 128
    kv_capacity_tokens: int = 2_000_000
    initial_tokens: tuple[int, int] = (2_000, 6_000)
    final_tokens: tuple[int, int] = (60_000, 100_000)
    output_tokens: tuple[int, int] = (100, 600)
    tool_tokens: tuple[int, int] = (300, 3_000)
    big_tool_tokens: tuple[int, int] = (6_000, 15_000)
    big_tool_prob: float = 0.08
    tool_latency_s: tuple[float, float] = (1.0, 8.0)
    start_jitter_s: float = 2.0
    timeout_s: float = 600.0
    death_engine: int | None = None
    death_at_s: float = 0.0
    recover_at_s: float | None = None
    seed: int = 7
    cost: CostModel = field(default_factory=CostModel)


SCENARIOS: dict[str, SimConfig] = {
    "storm": SimConfig(),
    "engine_death": SimConfig(
        engines=4, dp_ranks=2, death_engine=1, death_at_s=240.0, recover_at_s=480.0
    ),
}


def quick(cfg: SimConfig) -> SimConfig:
    """A smaller batch on the same cluster (KV scaled with it): seconds for all policies."""
    return replace(cfg, sessions=96, kv_capacity_tokens=1_500_000)



def add_scenario_args(ap: argparse.ArgumentParser) -> None:
    """The flags that pick and shrink a scenario (`scenario_from_args`), for every entry point."""
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="storm")
    ap.add_argument("--quick", action="store_true", help="smaller batch, shorter sessions")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)


def scenario_from_args(args: argparse.Namespace) -> SimConfig:
    cfg = SCENARIOS[args.scenario]
    if args.quick:
        cfg = quick(cfg)
    if args.sessions is not None:
        cfg = replace(cfg, sessions=args.sessions)
    if args.seed is not None:
        cfg = replace(cfg, seed=args.seed)
    return cfg


@dataclass(frozen=True, slots=True)
class TurnScript:
    new_tokens: int  # prompt tokens appended before this turn (turn 0: the initial prompt)
    output_tokens: int
    tool_latency_s: float  # after this turn, before the next one arrives


def make_sessions(cfg: SimConfig) -> list[list[TurnScript]]:
    rng = random.Random(cfg.seed)
    out: list[list[TurnScript]] = []
    for _ in range(cfg.sessions):
        final = rng.randint(*cfg.final_tokens)
        ctx = rng.randint(*cfg.initial_tokens)
        turns: list[TurnScript] = []
        new = ctx
        while True:
            o = rng.randint(*cfg.output_tokens)
            turns.append(TurnScript(new, o, rng.uniform(*cfg.tool_latency_s)))
            ctx += o
            if ctx >= final:
                break
            big = rng.random() < cfg.big_tool_prob
            new = rng.randint(*(cfg.big_tool_tokens if big else cfg.tool_tokens))
            ctx += new
        out.append(turns)
    return out

