"""Two journal write paths against each other, and each against no journal, in one run.

`journal.py`'s warm pairs measure one checkout's journal against no journal; comparing
two write paths that way means two runs minutes apart, whose difference is mostly the
shared machine's drift. Here three servers (each with its own simulated engine) run at
once, started and warmed once: no journal (`off`), a journal served by the code of
another checkout (`base`, `--base DIR`: e.g. `git archive main | tar -x -C DIR`), and
a journal served by this checkout's code (`new`). Each round drives six short legs in
the order off, base, new, new, base, off (64 agents x `--turns` turns on fresh
sessions, left open, as `journal.py`), so every mode of a round sees the same machine;
the paired samples are per-round differences of CPU per turn (the server process and
its live children) and ratios of p50 / p99 turn latency, summarised by their median
and a 90% bootstrap interval.

    python bench/journal_ab.py --base /tmp/main-tree --rounds 12 --json bench/results/journal_ab.json

Two settings of one checkout: `--base .` and `--new-arg` (repeatable) for the flags the
`new` server adds, e.g. the journal's sync mode:

    python bench/journal_ab.py --base . --new-arg=--journal-sync=normal --rounds 12 \
        --json bench/results/journal_ab_sync_normal.json

Run it from this checkout's root (each `serve` imports the code of its working directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import PIDS, server, sim_engine  # noqa: E402
from bench.journal import INSTANCE, _bootstrap_ci, _pct, _writer_cpu_s, filesystem, journal_root  # noqa: E402
from bench.turn_cost import _phase, server_cpu_s  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

MODES = ("off", "base", "new")
ORDER = ("off", "base", "new", "new", "base", "off")


def _leg(url: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[float]]:
    lat: list[float] = []
    w0 = asyncio.run(_writer_cpu_s(url))
    c0, t0 = server_cpu_s(PIDS[url]), time.monotonic()
    n = asyncio.run(_phase(url, args.agents, args.turns, args.max_tokens, latencies=lat, kept=[]))
    cpu, wall = server_cpu_s(PIDS[url]) - c0, time.monotonic() - t0
    writer = asyncio.run(_writer_cpu_s(url)) - w0
    return {"turns": n, "cpu_ms_per_turn": round(1000 * cpu / n, 3), "writer_cpu_ms_per_turn": round(1000 * writer / n, 4),
            "p50_ms": round(1000 * _pct(lat, 0.5), 2), "p99_ms": round(1000 * _pct(lat, 0.99), 2),
            "turns_per_s": round(n / wall, 1), "load1": round(os.getloadavg()[0], 2)}, lat


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = str(cached_tokenizer_dir(args.family))
    root = journal_root(args.dir)
    dirs = {m: Path(tempfile.mkdtemp(prefix=f"tito-ab-{m}-", dir=root)) for m in ("base", "new")}
    base_cli = ["bash", "-c", 'cd "$1" && shift && exec "$0" -m session_server.ops.cli "$@"', sys.executable,
                str(args.base.resolve())]
    legs: list[dict[str, Any]] = []
    lat: dict[str, list[float]] = {m: [] for m in MODES}
    result: dict[str, Any] = {"base": str(args.base), "new_args": args.new_arg, "filesystem": filesystem(root), "cpus": os.cpu_count(),
                              "agents": args.agents, "turns_per_agent_per_leg": args.turns, "rounds": args.rounds,
                              "loadavg_start": os.getloadavg()}
    try:
        with contextlib.ExitStack() as stack:
            urls: dict[str, str] = {}
            for mode in MODES:
                engine = stack.enter_context(sim_engine("sglang", tokenizer))
                extra = [] if mode == "off" else ["--journal-dir", str(dirs[mode]), "--instance-id", INSTANCE]
                extra += args.new_arg if mode == "new" else []
                cli = {"cli": base_cli} if mode == "base" else {}
                urls[mode] = stack.enter_context(server([engine], tokenizer, extra=extra, **cli))
            for mode in MODES:
                asyncio.run(_phase(urls[mode], args.agents, args.warmup, args.max_tokens, kept=[]))
            for r in range(args.rounds):
                for mode in ORDER:
                    leg, leg_lat = _leg(urls[mode], args)
                    legs.append({"round": r, "mode": mode, **leg})
                    lat[mode] += leg_lat
                print(json.dumps(legs[-len(ORDER):]), file=sys.stderr, flush=True)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)

    def per_round(key: str, mode: str, r: int) -> float:
        return statistics.fmean(x[key] for x in legs if x["round"] == r and x["mode"] == mode)

    summary: dict[str, Any] = {}
    for a, b in (("base", "off"), ("new", "off"), ("new", "base")):
        cpu = [per_round("cpu_ms_per_turn", a, r) - per_round("cpu_ms_per_turn", b, r) for r in range(args.rounds)]
        entry: dict[str, Any] = {"cpu_ms_per_turn_diffs": [round(d, 3) for d in cpu],
                                 "cpu_ms_per_turn_median_diff": round(statistics.median(cpu), 3),
                                 "cpu_ms_per_turn_median_diff_ci90": _bootstrap_ci(cpu)}
        for key in ("p50_ms", "p99_ms"):
            ratios = [per_round(key, a, r) / per_round(key, b, r) for r in range(args.rounds)]
            entry[f"{key}_median_ratio"] = round(statistics.median(ratios), 3)
            entry[f"{key}_median_ratio_ci90"] = _bootstrap_ci(ratios)
        summary[f"{a}_vs_{b}"] = entry
    for mode in MODES:
        mine = [x for x in legs if x["mode"] == mode]
        summary[mode] = {k: round(statistics.median(x[k] for x in mine), 4)
                         for k in ("cpu_ms_per_turn", "writer_cpu_ms_per_turn", "turns_per_s")}
        summary[mode].update(p50_ms_pooled=round(1000 * _pct(lat[mode], 0.5), 2),
                             p99_ms_pooled=round(1000 * _pct(lat[mode], 0.99), 2))
    return {**result, "legs": legs, "summary": summary, "loadavg_end": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a checkout whose server is the `base` journal")
    ap.add_argument("--new-arg", action="append", default=[], metavar="ARG",
                    help="a serve flag for the `new` server only (repeatable; --new-arg=--flag=value)")
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--turns", type=int, default=12, help="turns per agent per leg")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12, help="rounds of six legs (off, base, new, new, base, off)")
    ap.add_argument("--dir", type=Path, default=None, help="where the journals go (default: as journal.py)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    result = run(args)
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
