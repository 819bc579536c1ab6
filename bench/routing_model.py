"""Routing simulation, the engine model: a DP rank's prefix cache and queues, and an
engine whose ranks step in lock-step under a per-iteration cost model.

An iteration lasts alpha + beta * prefill tokens + gamma * decode batch of the
*slowest* rank, so one rank's long prefill slows every rank's decode. `calibrate`
measures that on the model itself (one rank prefilling 41K tokens takes ~35 s while
the other ranks' decode falls from ~68 to 3-8 tok/s).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

__all__ = ["CostModel", "Job", "Rank", "SimEngine", "calibrate"]


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

