"""Run one bench script against two commits, alternating, in one run.

The machine is shared and its load drifts over minutes, so two numbers measured an
hour apart (or even back to back, old then new) compare the machine as much as the
code. This runs the same bench command on an old and a new ref in ABBA order
(old, new, new, old, old, new, ...: each side gets the same share of early and late
slots, so a steady drift cancels) and reports each side's median.

    python bench/alternate.py --old 1282d1d --new HEAD --rounds 3 \\
        --key median_cpu_ms_per_turn --json bench/results/turn_cost_alt.json \\
        -- bench/turn_cost.py --family qwen3 --runs 1

Each ref is checked out as a detached `git worktree` in a temporary directory (removed
at the end, also on an error or Ctrl-C), and each run is `<this python> <script> <args>
--json <tmp file>` with that worktree as its working directory and PYTHONPATH, so each
side imports its own server and runs its own copy of the bench script (an option the
old script lacks fails that run, loudly). Only committed code is compared: uncommitted
changes in this checkout are not in either worktree (a warning says so).

`--bench-from here` copies this checkout's `bench/` (as it is on disk) over both
worktrees' instead: the same measurement on both sides, each side's own server. That
is how a mode added to a bench script after the old ref is compared (the old ref's
server still has to support what the mode asks of it).

`--key` (repeatable) names a number in the scripts' JSON by a dotted path; a numeric
segment indexes a list (`health_ms.p99`, `levels.0.p99_s`). The output JSON holds
`old` and `new` (`ref`, `sha`, `runs`: each run's JSON, `slots`: where in the order
each ran, `wall_s`), `order`, `command`, and per key the medians and new/old ratio.
A run that fails or passes `--timeout-s` stops the whole run; what was measured so
far is still written, with `incomplete` saying why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SIDES = ("old", "new")


def abba_order(rounds: int) -> list[str]:
    """`rounds` runs per side: old, new, new, old, old, new, ... (pairs alternate which side leads)."""
    out: list[str] = []
    for r in range(rounds):
        out += list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
    return out


def lookup(data: Any, path: str) -> float | None:
    """The number at a dotted path (numeric segments index lists); None where it is missing
    or not a number (a bool is not one)."""
    cur = data
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return float(cur) if isinstance(cur, (int, float)) and not isinstance(cur, bool) else None


def summarize(old_runs: Sequence[Any], new_runs: Sequence[Any], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per key: each side's values, their medians (over the runs that have the key) and new/old."""
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        vals = {side: [lookup(r, key) for r in runs] for side, runs in zip(SIDES, (old_runs, new_runs), strict=True)}
        med = {side: statistics.median(present) if (present := [v for v in v_ if v is not None]) else None
               for side, v_ in vals.items()}
        ratio = med["new"] / med["old"] if med["old"] and med["new"] is not None else None
        out[key] = {"old_values": vals["old"], "new_values": vals["new"], "old_median": med["old"],
                    "new_median": med["new"], "new_over_old": ratio}
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    def num(v: float | None, none: str = "missing") -> str:
        return none if v is None else f"{v:.4g}"

    lines = ["| key | old median | new median | new/old | old runs | new runs |", "|---|---|---|---|---|---|"]
    for key, s in summary.items():
        lines.append(f"| {key} | {num(s['old_median'])} | {num(s['new_median'])} | {num(s['new_over_old'], '-')} | "
                     f"{', '.join(map(num, s['old_values']))} | {', '.join(map(num, s['new_values']))} |")
    return "\n".join(lines)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def worktrees(repo: Path, shas: dict[str, str], root: Path, bench_here: bool) -> Iterator[dict[str, Path]]:
    """A detached worktree per side under `root` (with this checkout's bench/ over its
    own if `bench_here`), removed (and pruned) however this ends."""
    made: dict[str, Path] = {}
    try:
        for side, sha in shas.items():
            path = root / side
            _git("worktree", "add", "--detach", "--quiet", str(path), sha, cwd=repo)
            made[side] = path
            if bench_here:
                shutil.copytree(repo / "bench", path / "bench", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("results", "__pycache__"))
        yield made
    finally:
        for path in made.values():
            with contextlib.suppress(subprocess.CalledProcessError):
                _git("worktree", "remove", "--force", str(path), cwd=repo)
        with contextlib.suppress(subprocess.CalledProcessError):
            _git("worktree", "prune", cwd=repo)


def _own_session() -> None:
    """In the child before exec: its own session (a Ctrl-C meant for us does not reach it
    half-way through a measurement), and SIGINT back to the default, which a shell's
    background job inherits as ignored, so `_stop`'s SIGINT becomes a KeyboardInterrupt."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT first, so the bench's own `finally` blocks stop the servers it started; then
    its whole process group (it was started as the leader of a new one)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left (servers it did not stop)
    proc.wait()


def run_once(worktree: Path, command: Sequence[str], out: Path, timeout_s: float) -> tuple[dict[str, Any], float]:
    """One run of the bench command in `worktree`: its JSON and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(worktree)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, *command, "--json", str(out)], cwd=worktree, env=env,
                            preexec_fn=_own_session)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RuntimeError(f"timed out after {timeout_s:g}s") from None
    except BaseException:  # Ctrl-C here: the child is in its own session and did not get it
        _stop(proc)
        raise
    if rc != 0:
        raise RuntimeError(f"exited with {rc}")
    return json.loads(out.read_text()), round(time.monotonic() - t0, 3)


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: alternate.py [options] -- SCRIPT [ARGS...] (the bench command after --)")
    i = list(argv).index("--")
    return list(argv[:i]), list(argv[i + 1:])


def main(argv: Sequence[str] | None = None) -> int:
    ours, command = _split_argv(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s --old REF --new REF [options] -- SCRIPT [ARGS...]")
    ap.add_argument("--old", required=True, help="the baseline git ref")
    ap.add_argument("--new", required=True, help="the ref compared with it")
    ap.add_argument("--rounds", type=int, default=3, help="runs per side")
    ap.add_argument("--key", action="append", default=[], help="a dotted path to a number in the JSON (repeatable)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="limit for one run")
    ap.add_argument("--bench-from", choices=("each", "here"), default="each",
                    help="each: every ref runs its own bench/; here: this checkout's bench/ on both sides")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(ours)
    if not command:
        ap.error("no bench command after --")
    if any(a == "--json" or a.startswith("--json=") for a in command):
        ap.error("the bench command gets its --json from here; leave it out")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    repo = Path(_git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
    refs = {"old": args.old, "new": args.new}
    shas = {side: _git("rev-parse", "--verify", f"{ref}^{{commit}}", cwd=repo) for side, ref in refs.items()}
    if _git("status", "--porcelain", "--untracked-files=no", cwd=repo):
        print("alternate: warning: this checkout has uncommitted changes; only committed code is compared",
              file=sys.stderr)
    order = abba_order(args.rounds)
    result: dict[str, Any] = {
        side: {"ref": refs[side], "sha": shas[side], "runs": [], "slots": [], "wall_s": []} for side in SIDES}
    result.update({"order": order, "command": command, "timeout_s": args.timeout_s, "bench_from": args.bench_from})
    status = 0
    with tempfile.TemporaryDirectory(prefix="bench-alternate-") as tmp, \
            worktrees(repo, shas, Path(tmp), args.bench_from == "here") as trees:
        try:
            for slot, side in enumerate(order):
                print(f"alternate: run {slot + 1}/{len(order)}: {side} {refs[side]} ({shas[side][:10]})",
                      file=sys.stderr, flush=True)
                try:
                    data, wall = run_once(trees[side], command, Path(tmp) / f"run{slot}.json", args.timeout_s)
                except RuntimeError as exc:
                    result["incomplete"] = f"run {slot + 1} ({side} {refs[side]}): {exc}"
                    print(f"alternate: {result['incomplete']}; stopping", file=sys.stderr)
                    status = 1
                    break
                for k, v in (("runs", data), ("slots", slot), ("wall_s", wall)):
                    result[side][k].append(v)
        except KeyboardInterrupt:
            result["incomplete"] = "interrupted"
            status = 130
    result["summary"] = summarize(result["old"]["runs"], result["new"]["runs"], args.key)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"old {refs['old']} ({shas['old'][:10]}): {len(result['old']['runs'])} runs; "
          f"new {refs['new']} ({shas['new'][:10]}): {len(result['new']['runs'])} runs")
    if args.key:
        print(table(result["summary"]))
    return status


if __name__ == "__main__":
    sys.exit(main())
