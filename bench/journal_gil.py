"""What sharing the GIL costs an SQLite writer: the journal's transaction, three ways.

The same transaction as the journal's under load (`--records` records of `--body` bytes,
each under a fresh session id, so the `sid` index takes a random page per record; WAL,
`synchronous=FULL`, on the repository's disk) is committed `--commits` times by a thread,
with a 2 ms pause between commits (a group-commit hold), while the main thread:

- `alone`: sleeps (the writer has the GIL to itself);
- `gil`: runs Python without pause (as `serve`'s event loop does under load: the writer
  must win the GIL back after each SQLite call releases it);
- `process`: sleeps, while another process burns a core (CPU contention, no GIL).

Reported per commit: the writer thread's CPU (`time.thread_time`) and wall time (less
the pause), medians of `--repeats` runs per mode, modes interleaved. If only `gil` moves
the CPU, the cost is the GIL's hand-offs, not SQLite's work or a busy machine: the
reason the journal's writer is a process (session_server/journal_writer.py).

    python bench/journal_gil.py --json bench/results/journal_gil.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.journal import filesystem, journal_root  # noqa: E402
from session_server.journal_file import connect  # noqa: E402

MODES = ("alone", "gil", "process")
PAUSE_S = 0.002
_INSERT = "INSERT INTO records (sid, kind, at, body, crc) VALUES (?, ?, ?, ?, ?)"


def _writer(root: Path, commits: int, records: int, body_len: int, out: list[tuple[float, float]]) -> None:
    d = Path(tempfile.mkdtemp(prefix="tito-gil-", dir=root))
    try:
        conn = connect(d / "j.sqlite3", None, "full")
        body = os.urandom(body_len)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for _ in range(commits):
            rows = [(os.urandom(16).hex(), "turn", time.time(), body, zlib.crc32(body)) for _ in range(records)]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(_INSERT, rows)
            conn.execute("COMMIT")
            time.sleep(PAUSE_S)
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        conn.close()
        out.append((1e6 * cpu / commits, 1e6 * (wall / commits - PAUSE_S)))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def one(mode: str, root: Path, args: argparse.Namespace) -> tuple[float, float]:
    out: list[tuple[float, float]] = []
    t = threading.Thread(target=_writer, args=(root, args.commits, args.records, args.body, out))
    burner = None
    if mode == "process":
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    t.start()
    try:
        if mode == "gil":
            x = 0
            while t.is_alive():
                for i in range(1000):
                    x += i
        t.join()
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    return out[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=600)
    ap.add_argument("--records", type=int, default=11, help="records per transaction (~the server's under load)")
    ap.add_argument("--body", type=int, default=700, help="bytes per record (~a small turn's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: as journal.py)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    root = journal_root(args.dir)
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            runs[mode].append(one(mode, root, args))
            print(mode, [round(x) for x in runs[mode][-1]], file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "commits": args.commits, "records_per_commit": args.records, "body_bytes": args.body,
        "filesystem": filesystem(root), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "per_commit": {m: {"cpu_us_median": round(statistics.median(c for c, _ in runs[m])),
                           "wall_us_median": round(statistics.median(w for _, w in runs[m])),
                           "cpu_us_runs": [round(c) for c, _ in runs[m]],
                           "wall_us_runs": [round(w) for _, w in runs[m]]} for m in MODES},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
