"""Routing simulation, the cluster: engines x DP ranks driven by the server's policy objects.

Every turn calls `policy.select(RoutingSignals(...))` on views of the ranks (the
same objects `EnginePool` uses); a request has a 600 s deadline from dispatch; a
timed-out turn aborts its session (a lost rollout); a turn on an engine that dies is
retried once on the policy's new choice.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

from bench.routing_model import Job, Rank, SimEngine
from bench.routing_workload import SimConfig, TurnScript
from session_server.routing import RoutingPolicy, RoutingSignals, TargetView

__all__ = ["BLOCK_TOKENS", "Cluster", "Stats"]

BLOCK_TOKENS = 256


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
        self.want_hashes = policy.needs_prefix_hashes

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

