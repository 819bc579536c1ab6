"""`--malloc-retain-mb` values against each other: throughput, /health and memory held after.

For each value (and then the values reversed, for `--rounds` 2 or more), a fresh
simulated engine whose replies carry the 1.36 MB routed-experts payload and a fresh
`serve` with that value; `responsiveness.py`'s workload (K=64 first-turn chats in
waves, `/health` polled from its own process) for `--seconds`; then 3 s idle and the
memory of `serve` and its helper processes (RSS and PSS summed, from /proc) and
their peak RSS. One row per run, in run order.

    python bench/malloc_retain.py --values 0,32,64,256 --rounds 2 \\
        --json bench/results/malloc_retain_sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import PIDS, descendants, server, sim_engine  # noqa: E402
from bench.responsiveness import _measure  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


def _tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def _status_kb(pid: int, field: str) -> int:
    try:
        return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def _pss_kb(pid: int) -> int:
    try:
        return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                    if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def one(tokenizer: str, retain_mb: int, seconds: float) -> dict[str, Any]:
    """One run: a fresh engine and server, the workload, then the memory held idle."""
    with sim_engine("sglang", tokenizer, extra=["--padding", "floats"], nice=10) as eng, server(
            [f"sglang={eng}"], tokenizer, extra=["--malloc-retain-mb", str(retain_mb)]) as url:
        m = asyncio.run(_measure(url, 64, seconds, 10, 0.0))
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # _measure lowered this process's priority
        time.sleep(3)
        pids = _tree(PIDS[url])
        return {"retain_mb": retain_mb, "chats_per_s": round(m["chats_per_s"], 1),
                "p99": round(m["health_ms"]["p99"], 1), "p50": round(m["health_ms"]["p50"], 2),
                "idle_rss_mb": sum(_status_kb(p, "VmRSS") for p in pids) // 1024,
                "idle_pss_mb": sum(_pss_kb(p) for p in pids) // 1024,
                "peak_rss_mb": sum(_status_kb(p, "VmHWM") for p in pids) // 1024, "procs": len(pids),
                "errors": m["errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", default="0,32,64,256", help="comma-separated --malloc-retain-mb values")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the values, every other one reversed")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    values = [int(v) for v in args.values.split(",")]
    order = [v for r in range(args.rounds) for v in (values if r % 2 == 0 else values[::-1])]
    tokenizer = str(cached_tokenizer_dir("qwen3"))
    runs = []
    for v in order:
        runs.append(one(tokenizer, v, args.seconds))
        print(runs[-1], flush=True)
    args.json.write_text(json.dumps({"command": " ".join(sys.argv), "loadavg_end": os.getloadavg(), "runs": runs},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
