"""Training samples at library level: throughput, peak RSS, and memory per unique token with forks.

No server: trees are built the way the server commits turns
(`TrajectoryTree.commit_turn`, i.e. `LinearTrajectory.commit_turn` on the active branch).

1. **Throughput.** 1,000 sessions of about 8K tokens (8 turns each: a long first
   prompt, then tool output, sampled output with logprobs and a weight version,
   a closing repair token after a ``length`` finish; every 8th session retries its
   last turn once, so the default picker has something to drop). Timed:
   `trajectory.samples.build_samples` for every session, then
   `trajectory.sample_formats.samples_to_safetensors` of the whole batch, i.e.
   what ``POST /samples`` does for a rollout worker. Reported in sample tokens/s
   (tokens of the returned samples) with the wall seconds of each step; loading
   the payload back (`load_samples_safetensors`) is timed too.
2. **Peak RSS** of the whole run (``ru_maxrss``).
3. **Bytes per unique token with forks.** A session whose final line is about
   50K tokens, built twice from the same turns: once with 8 rollbacks (at 8
   evenly spaced turns k the agent abandons turn k: `tree.rollback(k)`
   then a new turn), once linearly (the same turns, retried ones included,
   committed one after the other). Memory of each tree is measured from outside
   (a `tracemalloc` snapshot diff around building it; numpy reports its buffers
   to tracemalloc), divided by the *unique* tokens: the tokens each branch added
   after its fork point, summed over branches (the same number for both trees).
   Target: forked / linear <= 1.10. Turns carry no messages
   here, so the number is about token storage.

    python bench/samples.py --json bench/results/samples.json
    python bench/samples.py --quick --json /tmp/samples.json   # seconds, for CI
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trajectory.sample_formats import load_samples_safetensors, samples_to_safetensors  # noqa: E402
from trajectory.samples import build_samples  # noqa: E402
from trajectory.tree import TrajectoryTree  # noqa: E402

VOCAB = 151_000
TARGET_RATIO = 1.10


@dataclass(frozen=True, slots=True)
class Turn:
    """One generation as the server commits it."""

    prompt: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    repair: np.ndarray
    weight_version: int


@dataclass(frozen=True, slots=True)
class Shape:
    sessions: int
    session_tokens: int
    turns: int
    fork_tokens: int  # final line of the forked session
    fork_turns: int
    forks: int


FULL = Shape(sessions=1000, session_tokens=8192, turns=8, fork_tokens=50_000, fork_turns=50, forks=8)
QUICK = Shape(sessions=40, session_tokens=2048, turns=6, fork_tokens=5000, fork_turns=20, forks=8)


def make_turns(rng: np.random.Generator, total: int, n_turns: int) -> list[Turn]:
    """`n_turns` turns of about `total` tokens: a first prompt of ~20 %, then about
    55 % prompt (tool output) / 45 % sampled in each later turn; ~1 in 5 turns
    finishes on ``length`` and gets one repair token (mask 0)."""
    first = total // 5
    per_turn = (total - first) // n_turns
    turns = []
    for i in range(n_turns):
        n_prompt = first if i == 0 else int(per_turn * 0.55)
        n_sampled = per_turn - (0 if i == 0 else n_prompt)
        length = bool(rng.random() < 0.2)
        turns.append(Turn(
            prompt=rng.integers(0, VOCAB, n_prompt, dtype=np.int32),
            sampled=rng.integers(0, VOCAB, n_sampled, dtype=np.int32),
            logprobs=-rng.exponential(0.5, n_sampled).astype(np.float32),
            finish_reason="length" if length else ("stop" if i == n_turns - 1 else "tool_calls"),
            repair=np.array([VOCAB - 1] if length else [], dtype=np.int32),
            weight_version=int(i // 3),
        ))
    return turns


def commit(tree: TrajectoryTree, t: Turn) -> None:
    """`TrajectoryTree.commit_turn`: `LinearTrajectory.commit_turn` on the active branch."""
    tree.commit_turn(t.prompt, t.sampled, t.logprobs, finish_reason=t.finish_reason,
                     repair_ids=t.repair, weight_version=t.weight_version)


def turn_tokens(t: Turn) -> int:
    return int(t.prompt.shape[0] + t.sampled.shape[0] + t.repair.shape[0])


def build_session(turns: list[Turn], retry: Turn | None) -> tuple[TrajectoryTree, int]:
    """A session of `turns`; with `retry`, the last turn is first tried as `retry`,
    then retried (`rollback`) as the real one: an abandoned leaf. Also returns the
    tokens committed."""
    tree = TrajectoryTree()
    for t in turns[:-1]:
        commit(tree, t)
    if retry is not None:
        commit(tree, retry)
        tree.rollback(len(turns) - 1)
    commit(tree, turns[-1])
    return tree, sum(map(turn_tokens, turns)) + (0 if retry is None else turn_tokens(retry))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def throughput(shape: Shape, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    trees, committed = [], 0
    for i in range(shape.sessions):
        turns = make_turns(rng, shape.session_tokens, shape.turns)
        retry = make_turns(rng, shape.session_tokens, shape.turns)[-1] if i % 8 == 7 else None
        tree, n = build_session(turns, retry)
        trees.append(tree)
        committed += n
    build_trees_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    samples = [s for tree in trees for s in build_samples(tree, metadata={"bench": "samples"})]
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    payload = samples_to_safetensors(samples)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = load_samples_safetensors(payload)
    load_s = time.perf_counter() - t0

    tokens = sum(len(s) for s in samples)
    assert len(loaded) == len(samples) and sum(len(s) for s in loaded) == tokens
    wall = build_s + write_s
    return {
        "sessions": shape.sessions,
        "turns_per_session": shape.turns,
        "committed_tokens": committed,
        "samples": len(samples),
        "sample_tokens": tokens,
        "trainable_tokens": sum(s.num_trainable for s in samples),
        "build_trees_s": build_trees_s,
        "build_samples_s": build_s,
        "safetensors_s": write_s,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "build_samples_tokens_per_s": tokens / build_s,
        "safetensors_tokens_per_s": tokens / write_s,
        "load_s": load_s,
        "load_tokens_per_s": tokens / load_s,
        "payload_bytes": len(payload),
        "payload_bytes_per_token": len(payload) / tokens,
    }


def traced_bytes(build: Callable[[], TrajectoryTree]) -> tuple[int, TrajectoryTree]:
    """Bytes still allocated after `build()` that were not before (the tree it returns)."""
    gc.collect()
    before = tracemalloc.take_snapshot()
    tree = build()
    gc.collect()
    after = tracemalloc.take_snapshot()
    return sum(s.size_diff for s in after.compare_to(before, "filename")), tree


def forked_session(turns: list[Turn], retries: dict[int, Turn]) -> TrajectoryTree:
    """The turns in order; after turn index k in `retries`, roll back and redo it."""
    tree = TrajectoryTree()
    for k, t in enumerate(turns):
        if k in retries:
            commit(tree, retries[k])
            tree.rollback(k)
        commit(tree, t)
    return tree


def linear_session(turns: list[Turn], retries: dict[int, Turn]) -> TrajectoryTree:
    """The same tokens as `forked_session`, committed on one line."""
    tree = TrajectoryTree()
    for k, t in enumerate(turns):
        if k in retries:
            commit(tree, retries[k])
        commit(tree, t)
    return tree


def fork_memory(shape: Shape, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed + 1)
    turns = make_turns(rng, shape.fork_tokens, shape.fork_turns)
    spare = make_turns(rng, shape.fork_tokens, shape.fork_turns)
    points = np.linspace(1, shape.fork_turns - 1, shape.forks).round().astype(int).tolist()
    retries = {k: spare[k] for k in points}
    tracemalloc.start()
    try:
        forked_bytes, forked = traced_bytes(lambda: forked_session(turns, retries))
        linear_bytes, linear = traced_bytes(lambda: linear_session(turns, retries))
    finally:
        tracemalloc.stop()
    # every committed turn is new tokens (each branch's own, after its fork point): counted
    # from the inputs, not read back from the trees, so no storage layout is assumed
    unique = sum(map(turn_tokens, turns)) + sum(map(turn_tokens, retries.values()))
    del forked, linear
    forked_bpt, linear_bpt = forked_bytes / unique, linear_bytes / unique
    return {
        "line_tokens": sum(map(turn_tokens, turns)),
        "forks": len(retries),
        "fork_turns": points,
        "unique_tokens": unique,
        "forked_bytes": forked_bytes,
        "linear_bytes": linear_bytes,
        "forked_bytes_per_token": forked_bpt,
        "linear_bytes_per_token": linear_bpt,
        "ratio": forked_bpt / linear_bpt,
        "target_ratio": TARGET_RATIO,
        "meets_target": forked_bpt / linear_bpt <= TARGET_RATIO,
    }


def run(quick: bool, seed: int = 0) -> dict[str, Any]:
    shape = QUICK if quick else FULL
    rss_start = peak_rss_mib()
    fork = fork_memory(shape, seed)  # first, so the throughput batch's garbage cannot blur it
    out = {"quick": quick, "seed": seed, "throughput": throughput(shape, seed), "fork_memory": fork}
    out["peak_rss_mib"] = peak_rss_mib()
    out["peak_rss_mib_at_start"] = rss_start
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="40 sessions x 2K tokens, a 5K-token forked session")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = run(args.quick, args.seed)
    tp, fm = out["throughput"], out["fork_memory"]
    print(f"{tp['samples']} samples, {tp['sample_tokens']:,} tokens: build {tp['build_samples_s']:.2f} s + "
          f"safetensors {tp['safetensors_s']:.2f} s = {tp['tokens_per_s'] / 1e6:.1f}M tokens/s; "
          f"{tp['payload_bytes_per_token']:.2f} B/token; load {tp['load_tokens_per_s'] / 1e6:.1f}M tokens/s")
    print(f"peak RSS {out['peak_rss_mib']:.0f} MiB")
    print(f"{fm['line_tokens']:,}-token line, {fm['forks']} forks, {fm['unique_tokens']:,} unique tokens: "
          f"{fm['forked_bytes_per_token']:.2f} B/token forked vs {fm['linear_bytes_per_token']:.2f} linear, "
          f"ratio {fm['ratio']:.2f} (target <= {TARGET_RATIO})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
