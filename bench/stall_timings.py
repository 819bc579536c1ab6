"""Time each event-loop stall source directly: the longest uninterrupted piece of work.

("loop stalls that grow with context or session count"). For each source
this measures the longest single step the event loop runs without yielding:

* TTL sweep at `--sessions` idle sessions (none due, 1% due, all due): the longest
  step of one sweep as the server's sweeper runs it.
* JSON trajectory export at `--tokens` tokens: the one-shot `orjson.dumps(to_dict(...))`
  and, where the library has it, the longest piece of the chunked `iter_json`; and how
  late a sleeping thread wakes while another thread exports in a loop (the GIL wait an
  event loop sees while the CPU offload exports).
* `cache_aware` prefix hashing at `--tokens` tokens: `prefix_block_hashes` plus one
  `CacheAware.select` with those hashes.
* A full `gc.collect()` with `--sessions` sessions alive, and the tracked-object count.

Runs against whatever `session_server`/`trajectory` the repository root holds, so the
same script gives the before and after numbers.

    python bench/stall_timings.py --json bench/results/stall_timings.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from session_server import app  # noqa: E402
from session_server.routing import prefix_block_hashes  # noqa: E402
from session_server.routing.cache_aware import CacheAware  # noqa: E402
from session_server.routing.policy import RoutingSignals, TargetView  # noqa: E402
from session_server.sessions import SessionConfig, SessionStore  # noqa: E402
from trajectory import export, export_stream  # noqa: E402
from trajectory.tree import TrajectoryTree  # noqa: E402


def _ms(samples: list[float]) -> dict[str, float]:
    arr = np.array(samples) * 1000
    return {"median": float(np.median(arr)), "max": float(arr.max()), "n": int(arr.size)}


def _time(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(n: int, ttl_s: float, clock: _Clock) -> SessionStore:
    store = SessionStore(max_sessions=n + 1, clock=clock)
    for i in range(n):
        clock.now = i * 1e-6  # distinct creation times, as in a real run
        store.create(SessionConfig(ttl_s=ttl_s))
    return store


def _sweep_steps(store: SessionStore) -> tuple[list[float], int]:
    """One sweep as the server runs it: a single `expire()` before the fix; batches of
    `SWEEP_BATCH` heap entries after (the sweeper yields to the loop between them)."""
    batch = getattr(app, "SWEEP_BATCH", None)
    steps: list[float] = []
    removed = 0
    while True:
        t0 = time.perf_counter()
        removed += len(store.expire() if batch is None else store.expire(limit=batch))
        steps.append(time.perf_counter() - t0)
        if batch is None or not store.expiry_due():
            return steps, removed


def sweep(n: int, reps: int) -> dict[str, Any]:
    clock = _Clock()
    store = _store(n, 3600.0, clock)
    clock.now = 1.0  # nothing due
    idle = [max(_sweep_steps(store)[0]) for _ in range(reps)]
    step = n * 1e-6 / 100  # 1% due per sweep: sessions created first are due first
    due: list[float] = []
    removed = 0
    for k in range(1, min(reps, 50) + 1):
        clock.now = 3600.0 + k * step
        steps, r = _sweep_steps(store)
        due.append(max(steps))
        removed += r
    clock.now = 1e9  # every remaining session due at once (all made in one burst)
    steps, r = _sweep_steps(store)
    return {"sessions": n, "none_due_longest_step_ms": _ms(idle), "one_percent_due_longest_step_ms": _ms(due),
            "one_percent_removed": removed, "all_due_longest_step_ms": max(steps) * 1000,
            "all_due_steps": len(steps), "all_due_removed": r}


def _tree(tokens: int, turns: int) -> TrajectoryTree:
    tree = TrajectoryTree()
    traj = tree.active.trajectory
    rng = np.random.default_rng(0)
    per = tokens // turns
    for t in range(turns):
        prompt = rng.integers(0, 150_000, per // 2, dtype=np.int32)
        sampled = rng.integers(0, 150_000, per - per // 2, dtype=np.int32)
        lps = -rng.random(sampled.size, dtype=np.float32)
        traj.commit_turn(prompt, sampled, lps, finish_reason="stop", weight_version=1,
                         request_messages=[{"role": "user", "content": f"turn {t}"}],
                         assistant_message={"role": "assistant", "content": "ok " * 20})
    return tree


def export_json(tokens: int, reps: int) -> dict[str, Any]:
    tree = _tree(tokens, turns=100)
    meta = {"session_id": "s", "metadata": {}, "history_policy": "append"}
    one_shot = _time(lambda: orjson.dumps(export.to_dict(tree, metadata=meta),
                                          option=orjson.OPT_SERIALIZE_NUMPY), reps)
    out: dict[str, Any] = {"tokens": len(tree.active.trajectory), "one_shot_ms": _ms(one_shot)}
    iter_json = getattr(export_stream, "iter_json", None)
    if iter_json is not None:
        longest: list[float] = []
        totals: list[float] = []
        pieces = 0
        for _ in range(reps):
            gen = iter_json(tree, metadata=meta)
            worst = 0.0
            t_all = time.perf_counter()
            pieces = 0
            while True:
                t0 = time.perf_counter()
                try:
                    next(gen)
                except StopIteration:
                    break
                worst = max(worst, time.perf_counter() - t0)
                pieces += 1
            totals.append(time.perf_counter() - t_all)
            longest.append(worst)
        out["chunked_longest_piece_ms"] = _ms(longest)
        out["chunked_total_ms"] = _ms(totals)
        out["chunked_pieces"] = pieces
    out["loop_delay_ms_one_shot_in_thread"] = _loop_delay_while(
        lambda: orjson.dumps(export.to_dict(tree, metadata=meta), option=orjson.OPT_SERIALIZE_NUMPY))
    if iter_json is not None:
        out["loop_delay_ms_chunked_in_thread"] = _loop_delay_while(
            lambda: export_stream.to_json_bytes(tree, metadata=meta))
    return out


def _loop_delay_while(work: Callable[[], Any], seconds: float = 1.0) -> dict[str, float]:
    """`work` repeated in a thread (as the server's CPU offload runs it, GIL switch interval
    0.5 ms as `serve` sets it); meanwhile this thread sleeps 1 ms at a time and records
    how late it wakes: what an event loop thread would wait for the GIL."""
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    stop = threading.Event()
    runs = 0

    def spin() -> None:
        nonlocal runs
        while not stop.is_set():
            work()
            runs += 1

    t = threading.Thread(target=spin)
    t.start()
    late: list[float] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - t0 - 0.001)
    stop.set()
    t.join()
    sys.setswitchinterval(old)
    arr = np.array(late) * 1000
    return {"p99": float(np.percentile(arr, 99)), "max": float(arr.max()), "exports_per_s": runs / seconds}


def prefix_hashing(tokens: int, reps: int) -> dict[str, Any]:
    ids = np.random.default_rng(1).integers(0, 150_000, tokens, dtype=np.int32)
    hashing = _time(lambda: prefix_block_hashes(ids), reps)
    hashes = prefix_block_hashes(ids)
    policy = CacheAware()
    targets = [TargetView(id=f"e{i}", healthy=True, in_flight=0, sessions=0) for i in range(4)]
    signals = RoutingSignals(session_id="s", home=None, targets=targets, context_tokens=tokens, prefix_hashes=hashes)
    select = _time(lambda: policy.select(signals), reps)
    return {"tokens": tokens, "blocks": len(hashes), "prefix_block_hashes_ms": _ms(hashing),
            "cache_aware_select_ms": _ms(select)}


def gc_pause(n: int, reps: int) -> dict[str, Any]:
    clock = _Clock()
    gc.collect()
    base = len(gc.get_objects())
    store = _store(n, 3600.0, clock)
    tracked = len(gc.get_objects()) - base
    full = _time(gc.collect, reps)
    gc.freeze()
    frozen = _time(gc.collect, reps)
    gc.unfreeze()
    del store
    gc.collect()
    return {"sessions": n, "tracked_objects_per_session": tracked / n, "tracked_objects": tracked,
            "full_collect_ms": _ms(full), "full_collect_after_freeze_ms": _ms(frozen)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    out = {
        "sweep": sweep(args.sessions, args.reps),
        "export_json": export_json(args.tokens, args.reps),
        "prefix_hashing": prefix_hashing(args.tokens, args.reps),
        "gc": gc_pause(args.sessions, max(3, args.reps // 5)),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
