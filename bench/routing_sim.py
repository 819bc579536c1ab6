"""Routing simulation: the server's policy objects driving a discrete-event cluster.

Owns the cluster model and the per-policy report (DESIGN.md sections 8 and 11).

- Cluster: engines x DP ranks. Each rank has a prefix (radix) cache of finite
  token capacity, LRU over sessions, evicted from the least recently used; a
  FIFO queue of prefills (chunked, `chunk_tokens` per iteration) and a decode
  batch. The ranks of one engine step in lock-step: an iteration lasts
  alpha + beta * prefill tokens + gamma * decode batch of the *slowest* rank, so
  one rank's long prefill slows every rank's decode.
- Calibration (`calibrate`): one rank prefilling 41K tokens takes ~35 s while
  the other ranks' decode falls from ~68 to 3-8 tok/s; measured, not assumed.
- Sessions start together (an RL batch boundary), grow from a few K to ~100K
  tokens through model output (cached where it was generated) and tool output
  (new prompt tokens each turn), with a tool latency between turns.
- The "server": every turn calls `policy.select(RoutingSignals(...))` on views of
  the ranks (the same objects `EnginePool` uses); a request has a 600 s deadline
  from dispatch; a timed-out turn aborts its session (a lost rollout); a turn on
  an engine that dies is retried once on the policy's new choice.

    python bench/routing_sim.py --scenario storm --quick --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import re
import sys
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from session_server.routing import (  # noqa: E402
    POLICY_NAMES,
    RoutingPolicy,
    RoutingSignals,
    TargetView,
    make_policy,
)

REPORT_POLICIES = POLICY_NAMES
BLOCK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-iteration cost of one DP rank; the engine's iteration is the max over ranks."""

    alpha_s: float = 0.012
    beta_s_per_token: float = 0.000777
    gamma_s_per_seq: float = 0.0004
    chunk_tokens: int = 192

    def iteration_s(self, prefill_tokens: int, decode_batch: int) -> float:
        return (
            self.alpha_s
            + self.beta_s_per_token * prefill_tokens
            + self.gamma_s_per_seq * decode_batch
        )

    def prefill_tokens_per_s(self) -> float:
        return self.chunk_tokens / self.iteration_s(self.chunk_tokens, 0)


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


@dataclass(eq=False)
class Job:
    session: int
    turn: int
    context: int
    cached: int
    prefill_left: int
    out_left: int
    t_dispatch: float
    attempt: int
    rank: Rank
    t_first: float | None = None
    done: bool = False


@dataclass(eq=False)
class Rank:
    id: str
    engine: SimEngine
    capacity: int
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)
    cache_tokens: int = 0
    locked: dict[int, int] = field(default_factory=dict)
    queue: deque[Job] = field(default_factory=deque)
    batch: list[Job] = field(default_factory=list)
    homes: set[int] = field(default_factory=set)
    processed_tokens: int = 0

    def jobs(self) -> list[Job]:
        return list(self.queue) + self.batch

    def lookup(self, sid: int, context: int) -> int:
        if sid in self.cache:
            self.cache.move_to_end(sid)
            return min(self.cache[sid], context)
        return 0

    def insert(self, sid: int, tokens: int) -> None:
        self.cache_tokens += tokens - self.cache.get(sid, 0)
        self.cache[sid] = tokens
        self.cache.move_to_end(sid)
        for victim in list(self.cache):
            if self.cache_tokens <= self.capacity:
                break
            if self.locked.get(victim, 0) == 0:
                self.cache_tokens -= self.cache.pop(victim)

    def clear(self) -> None:
        self.cache.clear()
        self.cache_tokens = 0
        self.locked.clear()
        self.queue.clear()
        self.batch.clear()


@dataclass(eq=False)
class SimEngine:
    index: int
    cost: CostModel
    ranks: list[Rank] = field(default_factory=list)
    healthy: bool = True
    clock: float = 0.0
    busy: bool = False
    version: int = 0
    k: int = 0
    iter_s: float = 0.0
    chunks: list[int] = field(default_factory=list)
    min_iter_rate: float = math.inf  # slowest decode step seen while some rank decoded

    def plan(self) -> float | None:
        """Fix the iteration shape until the next completion; the phase end time or None."""
        self.version += 1
        k = math.inf
        chunks, worst = [], 0.0
        has_decode = False
        for r in self.ranks:
            p = 0
            if r.queue:
                left = r.queue[0].prefill_left
                p = min(self.cost.chunk_tokens, left)
                k = min(k, left // p if left >= self.cost.chunk_tokens else 1)
            if r.batch:
                has_decode = True
                k = min(k, min(j.out_left for j in r.batch))
            chunks.append(p)
            worst = max(worst, self.cost.iteration_s(p, len(r.batch)))
        if k == math.inf:
            self.busy = False
            return None
        self.busy, self.k, self.iter_s, self.chunks = True, int(k), worst, chunks
        if has_decode:
            self.min_iter_rate = min(self.min_iter_rate, 1.0 / worst)
        return self.clock + self.k * self.iter_s

    def advance(self, n: int) -> list[Job]:
        """Run n planned iterations; jobs whose prefill or decode completed at the end."""
        changed: list[Job] = []
        if n <= 0:
            return changed
        self.clock += n * self.iter_s
        for r, p in zip(self.ranks, self.chunks, strict=True):
            for j in r.batch:
                j.out_left -= n
                r.processed_tokens += n
            if p:
                head = r.queue[0]
                head.prefill_left -= n * p
                r.processed_tokens += n * p
                if head.prefill_left == 0:
                    r.queue.popleft()
                    head.t_first = self.clock
                    head.out_left -= 1
                    r.batch.append(head)
            for j in [j for j in r.batch if j.out_left <= 0]:
                r.batch.remove(j)
                changed.append(j)
        return changed

    def sync(self, t: float) -> list[Job]:
        """Commit every iteration that ends at or before... the first boundary >= t."""
        if not self.busy:
            self.clock = max(self.clock, t)
            return []
        n = min(self.k, max(0, math.ceil((t - self.clock) / self.iter_s - 1e-9)))
        return self.advance(n)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    reprefill_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    decode_rates: list[float] = field(default_factory=list)
    timeouts: int = 0
    lost_turns: int = 0
    completed_turns: int = 0
    migrations: int = 0
    rehomes: int = 0
    retries: int = 0
    aborted_sessions: int = 0
    makespan_s: float = 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class Cluster:
    """One simulation run of one policy."""

    def __init__(
        self, cfg: SimConfig, policy: RoutingPolicy, scripts: list[list[TurnScript]]
    ) -> None:
        self.cfg, self.policy, self.scripts = cfg, policy, scripts
        self.engines = [SimEngine(e, cfg.cost) for e in range(cfg.engines)]
        self.ranks: list[Rank] = []
        for eng in self.engines:
            for d in range(cfg.dp_ranks):
                r = Rank(f"e{eng.index}/{d}", eng, cfg.kv_capacity_tokens)
                eng.ranks.append(r)
                self.ranks.append(r)
        self.by_id = {r.id: r for r in self.ranks}
        self.home: dict[int, str] = {}
        self.context = [0] * len(scripts)  # tokens the session has seen (prompt + outputs)
        self.next_turn = [0] * len(scripts)
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.stats = Stats()
        self.now = 0.0
        self.want_hashes = getattr(policy, "name", "") == "cache_aware"

    def push(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    def views(self) -> list[TargetView]:
        return [
            TargetView(
                id=r.id,
                healthy=r.engine.healthy,
                in_flight=len(r.queue) + len(r.batch),
                sessions=len(r.homes),
                resident_tokens=r.cache_tokens,
                pending_prefill_tokens=sum(j.prefill_left for j in r.queue),
                kv_capacity_tokens=r.capacity,
                engine_id=f"e{r.engine.index}",
            )
            for r in self.ranks
        ]

    def replan(self, eng: SimEngine) -> None:
        end = eng.plan()
        if end is not None:
            self.push(end, "phase", (eng, eng.version))

    def dispatch(self, sid: int, attempt: int) -> None:
        turn = self.next_turn[sid]
        script = self.scripts[sid][turn]
        prompt = self.context[sid] + script.new_tokens
        hashes = None
        if self.want_hashes:
            base = sid << 32
            hashes = tuple(range(base, base + prompt // BLOCK_TOKENS))
        signals = RoutingSignals(
            session_id=f"s{sid}",
            home=self.home.get(sid),
            targets=self.views(),
            now_s=self.now,
            context_tokens=prompt,
            prefix_hashes=hashes,
        )
        choice = self.policy.select(signals)
        if choice is None:
            self.lose(sid)
            return
        old = self.home.get(sid)
        if old != choice:
            if old is not None:
                self.by_id[old].homes.discard(sid)
                if self.by_id[old].engine.healthy:
                    self.stats.migrations += 1
                else:
                    self.stats.rehomes += 1
            self.by_id[choice].homes.add(sid)
            self.home[sid] = choice
        rank = self.by_id[choice]
        eng = rank.engine
        for j in eng.sync(self.now):
            self.finish(j)
        cached = rank.lookup(sid, prompt)
        ideal = self.context[sid]
        st = self.stats
        st.prompt_tokens += prompt
        st.cached_tokens += cached
        st.ideal_cached_tokens += ideal
        st.reprefill_tokens += max(0, ideal - cached)
        # At least one token is always computed (SGLang re-runs the last prompt token on a full hit).
        job = Job(
            sid,
            turn,
            prompt,
            cached,
            max(1, prompt - cached),
            script.output_tokens,
            self.now,
            attempt,
            rank,
        )
        rank.locked[sid] = rank.locked.get(sid, 0) + 1
        rank.queue.append(job)
        self.push(self.now + self.cfg.timeout_s, "timeout", job)
        self.replan(eng)

    def finish(self, job: Job) -> None:
        job.done = True
        r, st = job.rank, self.stats
        r.locked[job.session] -= 1
        script = self.scripts[job.session][job.turn]
        t_done = job.rank.engine.clock
        st.completed_turns += 1
        st.latency_s.append(t_done - job.t_dispatch)
        assert job.t_first is not None
        st.ttft_s.append(job.t_first - job.t_dispatch)
        if script.output_tokens >= 32 and t_done > job.t_first:
            st.decode_rates.append((script.output_tokens - 1) / (t_done - job.t_first))
        total = job.context + script.output_tokens
        r.insert(job.session, total)
        sid = job.session
        self.context[sid] = total
        self.next_turn[sid] += 1
        if self.next_turn[sid] < len(self.scripts[sid]):
            self.push(t_done + script.tool_latency_s, "arrive", (sid, 1))
        else:
            st.makespan_s = max(st.makespan_s, t_done)

    def _unlink(self, job: Job) -> None:
        r = job.rank
        if job in r.batch:
            r.batch.remove(job)
        elif job in r.queue:
            r.queue.remove(job)
        if job.session in r.locked:
            r.locked[job.session] = max(0, r.locked[job.session] - 1)
        job.done = True

    def lose(self, sid: int) -> None:
        self.stats.lost_turns += 1
        self.stats.aborted_sessions += 1
        self.stats.makespan_s = max(self.stats.makespan_s, self.now)

    def on_timeout(self, job: Job) -> None:
        eng = job.rank.engine
        for j in eng.sync(self.now):
            self.finish(j)
        if job.done:
            self.replan(eng)
            return
        self._unlink(job)
        self.stats.timeouts += 1
        self.stats.latency_s.append(self.cfg.timeout_s)
        self.lose(job.session)
        self.replan(eng)

    def on_death(self, eng: SimEngine) -> None:
        for j in eng.sync(self.now):
            self.finish(j)
        failed = [j for r in eng.ranks for j in r.jobs()]
        eng.healthy = False
        eng.busy = False
        eng.version += 1
        for r in eng.ranks:
            r.clear()
        for j in failed:
            j.done = True
            if j.attempt >= 2:
                self.lose(j.session)
            else:
                self.stats.retries += 1
                self.dispatch(j.session, j.attempt + 1)

    def run(self) -> Stats:
        rng = random.Random(self.cfg.seed + 1)
        for sid in range(len(self.scripts)):
            self.push(rng.uniform(0, self.cfg.start_jitter_s), "arrive", (sid, 1))
        if self.cfg.death_engine is not None:
            self.push(self.cfg.death_at_s, "die", self.engines[self.cfg.death_engine])
            if self.cfg.recover_at_s is not None:
                self.push(self.cfg.recover_at_s, "recover", self.engines[self.cfg.death_engine])
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "arrive":
                self.dispatch(*payload)
            elif kind == "phase":
                eng, version = payload
                if version == eng.version and eng.healthy:
                    for j in eng.advance(eng.k):
                        self.finish(j)
                    self.replan(eng)
            elif kind == "timeout":
                if not payload.done:
                    self.on_timeout(payload)
            elif kind == "die":
                self.on_death(payload)
            elif kind == "recover":
                payload.healthy = True
                payload.clock = t
        return self.stats

    def report(self) -> dict[str, Any]:
        st = self.stats
        processed = [r.processed_tokens for r in self.ranks]
        mean = sum(processed) / len(processed)
        min_rate = min((e.min_iter_rate for e in self.engines), default=math.inf)
        return {
            "timeouts": st.timeouts,
            "lost_turns": st.lost_turns,
            "completed_turns": st.completed_turns,
            "hit_rate": st.cached_tokens / max(1, st.prompt_tokens),
            "ideal_hit_rate": st.ideal_cached_tokens / max(1, st.prompt_tokens),
            "reprefill_tokens": st.reprefill_tokens,
            "ttft_p50_s": _pct(st.ttft_s, 50),
            "ttft_p99_s": _pct(st.ttft_s, 99),
            "turn_latency_p50_s": _pct(st.latency_s, 50),
            "turn_latency_p99_s": _pct(st.latency_s, 99),
            "decode_rate_min_tok_s": min(st.decode_rates, default=0.0),
            "decode_rate_p50_tok_s": _pct(st.decode_rates, 50),
            "decode_step_rate_min_tok_s": 0.0 if min_rate == math.inf else min_rate,
            "makespan_s": st.makespan_s,
            "load_imbalance": max(processed) / mean if mean else 0.0,
            "migrations": st.migrations,
            "rehomes": st.rehomes,
            "retries": st.retries,
            "aborted_sessions": st.aborted_sessions,
        }


def calibrate(
    cost: CostModel, prefill_tokens: int = 41_000, ranks: int = 4, decode_batch: int = 6
) -> dict[str, float]:
    """Measure, on the model itself, one rank's long prefill and the others' decode rate."""
    eng = SimEngine(0, cost)
    for d in range(ranks):
        eng.ranks.append(Rank(f"c/{d}", eng, 1 << 30))

    def decoder(rank: Rank, out: int) -> Job:
        return Job(0, 0, 0, 0, 0, out, 0.0, 1, rank, t_first=0.0)

    # Undisturbed decode rate: every rank decodes only.
    for r in eng.ranks:
        r.batch = [decoder(r, 10**9) for _ in range(decode_batch)]
    eng.plan()
    idle_rate = 1.0 / eng.iter_s
    # Rank 0 prefills while the others keep decoding.
    big = Job(1, 0, prefill_tokens, 0, prefill_tokens, 1, 0.0, 1, eng.ranks[0])
    eng.ranks[0].batch = []
    eng.ranks[0].queue.append(big)
    other = eng.ranks[1].batch[0]
    before = other.out_left
    while big.t_first is None:
        eng.plan()
        eng.advance(eng.k)
    decoded = before - other.out_left
    return {
        "prefill_tokens": prefill_tokens,
        "prefill_s": big.t_first,
        "decode_tok_s_idle": idle_rate,
        "decode_tok_s_during_prefill": decoded / big.t_first,
        "prefill_tokens_per_s": cost.prefill_tokens_per_s(),
    }


def run_policy(name: str, cfg: SimConfig, scripts: list[list[TurnScript]]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if name == "sticky_cost":
        overrides["prefill_tokens_per_s"] = cfg.cost.prefill_tokens_per_s()
    t0 = time.perf_counter()
    cluster = Cluster(cfg, make_policy(name, **overrides), scripts)
    cluster.run()
    out = cluster.report()
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


COLUMNS = (
    ("timeouts", "timeouts", "{:d}"),
    ("lost_turns", "lost turns", "{:d}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("ideal_hit_rate", "ideal", "{:.1%}"),
    ("reprefill_tokens", "re-prefilled tok", "{:,}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.1f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.1f}"),
    ("turn_latency_p50_s", "turn p50 s", "{:.1f}"),
    ("turn_latency_p99_s", "turn p99 s", "{:.1f}"),
    ("decode_rate_min_tok_s", "min decode tok/s", "{:.1f}"),
    ("decode_rate_p50_tok_s", "p50 decode tok/s", "{:.1f}"),
    ("makespan_s", "makespan s", "{:.0f}"),
    ("load_imbalance", "imbalance", "{:.2f}"),
    ("migrations", "migrations", "{:d}"),
)


def markdown_table(result: dict[str, Any]) -> str:
    head = "| policy | " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|---|" + "---:|" * len(COLUMNS)
    rows = [
        f"| {name} | " + " | ".join(fmt.format(m[key]) for key, _, fmt in COLUMNS) + " |"
        for name, m in result["policies"].items()
    ]
    return "\n".join([head, sep, *rows])


def write_png(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    pol = result["policies"]
    panels = (
        ("hit_rate", "prefix hit rate (ideal dashed)"),
        ("turn_latency_p99_s", "turn latency p99 (s)"),
        ("timeouts", "timeouts"),
        ("reprefill_tokens", "re-prefilled tokens"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 4.5))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(names, [pol[n][key] for n in names], color="tab:blue")
        if key == "hit_rate":
            ax.plot(names, [pol[n]["ideal_hit_rate"] for n in names], "k--")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def update_readme(path: Path, scenario: str, body: str) -> None:
    """Replace only this scenario's subsection under '## Routing simulation'."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    sub = f"### {scenario}\n\n{body.strip()}\n"
    m = re.search(r"^## Routing simulation\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if m is None:
        intro = (
            "Same policy objects as the server, in a discrete-event cluster "
            "(`bench/routing_sim.py`). Regenerate with "
            "`python bench/routing_sim.py --scenario SCENARIO --readme bench/README.md`.\n"
        )
        text = text.rstrip("\n") + f"\n\n## Routing simulation\n\n{intro}\n{sub}"
    else:
        section = m.group(1)
        pat = re.compile(rf"^### {re.escape(scenario)}\n.*?(?=^### |\Z)", flags=re.S | re.M)
        section = (
            pat.sub(lambda _: sub + "\n", section)
            if pat.search(section)
            else section.rstrip("\n") + f"\n\n{sub}\n"
        )
        text = text[: m.start(1)] + section + text[m.end(1) :]
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="storm")
    ap.add_argument("--quick", action="store_true", help="smaller batch, shorter sessions")
    ap.add_argument("--policies", default=",".join(REPORT_POLICIES))
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--readme", type=Path, default=None, help="update this README's section")
    args = ap.parse_args(argv)
    cfg = SCENARIOS[args.scenario]
    if args.quick:
        cfg = quick(cfg)
    if args.sessions is not None:
        cfg = replace(cfg, sessions=args.sessions)
    if args.seed is not None:
        cfg = replace(cfg, seed=args.seed)
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
