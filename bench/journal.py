"""Durable sessions: what the journal (`serve --journal-dir`) costs a turn, the disk and a start.

1. **CPU per turn, journal off and on.** `turn_cost.py`'s workload (a simulated SGLang
   engine with no latency in its own process, `--agents` clients in a closed loop, each
   turn resending the history and asking for `--max-tokens` tokens; the qwen3 tokenizer),
   a fresh engine and server per leg, legs alternating off, on, on, off (ABBA) for
   `--rounds` rounds. Each leg reads the `serve` process's CPU (itself and its children,
   from /proc) around `--turns` turns per agent after `--warmup`. Sessions are left open
   (not deleted) in both modes, so the journal holds every turn it was given (a delete
   would compact its records away) and the two modes do the same work. The journal goes
   to a fresh directory on a real disk (the filesystem `df -T` names is printed and
   kept: fsync must be real, not tmpfs).
2. **Turn latency.** Each client times every measured turn (request sent -> reply read):
   p50 / p99 per leg, and turns/s.
   **Warm pairs** (`--warm-rounds N`): the same comparison with the machine's drift taken
   out. Both servers (each with its own engine) run at once, started and warmed once;
   each round drives short legs (`--warm-turns` turns per agent, a second or two) in
   the order off, on, on, off, so both modes of a round see the same machine. The
   per-round difference of CPU per turn (and ratio of p99) is summarised by its median
   with a 90% bootstrap interval; the journaling server's writer-process CPU per turn
   (`tito_journal_writer_cpu_seconds_total`) is read around each leg.
3. **Bytes on disk per stored token.** After each "on" leg: the journal's files (the
   database, its WAL) while the server runs, and the database alone once it stopped
   (SQLite checkpoints the WAL into it on close), divided by the sum of the sessions'
   `stored_tokens` (GET /sessions/{sid}).
4. **Recovery.** A journal of `--sessions` sessions x `--session-turns` turns of
   ~`--turn-tokens` tokens (new prompt ids and sampled ids with logprobs, a few hundred
   characters of messages each) written through `Journal` itself (the writer process,
   group commit, ~1,000 records per transaction), no HTTP. Timed: (a) `replay_rows(
   Journal(path).read(), time.monotonic)` in this process; (b) a `serve` process started
   on that directory, from spawn to `/health` 200, minus the same start on an empty
   directory (the median of `--starts` each). The recovered session count and a sample
   of sessions' token counts are checked both times.

    python bench/journal.py --json bench/results/journal.json

`--quick` shrinks everything (a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import CLI, PIDS, server, sim_engine  # noqa: E402
from bench.turn_cost import _phase, server_cpu_s  # noqa: E402
from session_server.journal import Journal, journal_path  # noqa: E402
from session_server.journal_records import CREATE, TURN, create_body, replay_rows, turn_body  # noqa: E402
from session_server.ops.harness import free_port  # noqa: E402
from session_server.sessions import Session, SessionConfig  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
INSTANCE = "bench"  # --instance-id: the journal file is {dir}/bench.sqlite3, session ids bench.{hex}


# -- where the journal goes -------------------------------------------------------


def filesystem(path: Path) -> dict[str, str]:
    """`df -T` of `path`: device, type, mount point."""
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
    fields = out.splitlines()[-1].split()
    return {"path": str(path), "device": fields[0], "type": fields[1], "mounted_on": fields[-1]}


def journal_root(given: Path | None) -> Path:
    """A directory on the repository's disk for the journals: the system temp directory
    when it is that filesystem (not tmpfs), else the repository's parent."""
    if given is not None:
        return given
    tmp = Path(tempfile.gettempdir())
    same = os.stat(tmp).st_dev == os.stat(REPO).st_dev
    return tmp if same and filesystem(tmp)["type"] != "tmpfs" else REPO.parent


def journal_bytes(directory: Path) -> dict[str, int]:
    """Sizes of the journal's files (database, WAL, shared memory index)."""
    db = journal_path(directory, INSTANCE)
    sizes = {}
    for suffix in ("", "-wal", "-shm"):
        f = db.with_name(db.name + suffix)
        sizes["db" + suffix.replace("-", "_")] = f.stat().st_size if f.exists() else 0
    return sizes


# -- 1-3: turns with the journal off and on ---------------------------------------


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _stored_tokens(url: str, sids: list[str]) -> int:
    async with aiohttp.ClientSession() as http:
        total = 0
        for sid in sids:
            async with http.get(f"{url}/sessions/{sid}") as r:
                r.raise_for_status()
                total += (await r.json())["stored_tokens"]
    return total


def turn_leg(journal: bool, tokenizer: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh engine and server, journal `journal`; warm-up, then the measured turns."""
    jdir = Path(tempfile.mkdtemp(prefix="tito-journal-", dir=root)) if journal else None
    extra = ["--journal-dir", str(jdir), "--instance-id", INSTANCE] if jdir else []
    out: dict[str, Any] = {"journal": journal}
    try:
        with sim_engine("sglang", tokenizer) as engine, server([engine], tokenizer, extra=extra) as url:
            pid = PIDS[url]
            kept: list[str] = []
            asyncio.run(_phase(url, args.agents, args.warmup, args.max_tokens, kept=kept))
            lat: list[float] = []
            cpu0, t0 = server_cpu_s(pid), time.monotonic()
            n = asyncio.run(_phase(url, args.agents, args.turns, args.max_tokens, latencies=lat, kept=kept))
            cpu, wall = server_cpu_s(pid) - cpu0, time.monotonic() - t0
            out.update(turns=n, cpu_s=round(cpu, 3), wall_s=round(wall, 3),
                       cpu_ms_per_turn=round(1000 * cpu / n, 3), turns_per_s=round(n / wall, 1),
                       p50_ms=round(1000 * _pct(lat, 0.50), 2), p99_ms=round(1000 * _pct(lat, 0.99), 2),
                       mean_ms=round(1000 * statistics.fmean(lat), 2))
            if jdir is not None:
                stored = asyncio.run(_stored_tokens(url, kept))
                running = journal_bytes(jdir)
                out.update(sessions=len(kept), stored_tokens=stored, bytes_running=running,
                           bytes_per_token_running=round((running["db"] + running["db_wal"]) / stored, 2))
        if jdir is not None:
            closed = journal_bytes(jdir)
            out.update(bytes_closed=closed,
                       bytes_per_token_closed=round((closed["db"] + closed["db_wal"]) / out["stored_tokens"], 2))
    finally:
        if jdir is not None:
            shutil.rmtree(jdir, ignore_errors=True)
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def turn_legs(tokenizer: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    legs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for journal in (False, True, True, False):
            leg = turn_leg(journal, tokenizer, root, args)
            leg["round"] = r
            legs.append(leg)
    summary: dict[str, Any] = {}
    for key in ("cpu_ms_per_turn", "p99_ms", "p50_ms", "turns_per_s"):
        off = round(statistics.median(x[key] for x in legs if not x["journal"]), 3)
        on = round(statistics.median(x[key] for x in legs if x["journal"]), 3)
        # the paired difference: within each round, mean(on) - mean(off) of its ABBA legs
        paired = [statistics.fmean(x[key] for x in legs if x["round"] == r and x["journal"])
                  - statistics.fmean(x[key] for x in legs if x["round"] == r and not x["journal"])
                  for r in range(args.rounds)]
        summary[key] = {"off": off, "on": on, "on_minus_off": round(on - off, 3),
                        "on_over_off": round(on / off, 3), "paired_round_diffs": [round(d, 3) for d in paired],
                        "median_paired_diff": round(statistics.median(paired), 3)}
    on_legs = [x for x in legs if x["journal"]]
    summary["bytes_per_stored_token_closed"] = statistics.median(x["bytes_per_token_closed"] for x in on_legs)
    summary["bytes_per_stored_token_running"] = statistics.median(x["bytes_per_token_running"] for x in on_legs)
    return {"legs": legs, "summary": summary}


# -- 1-2, warm: both servers up at once, short legs alternating --------------------


async def _writer_cpu_s(url: str) -> float:
    """`tito_journal_writer_cpu_seconds_total` of the server at `url` (0 without a journal)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("tito_journal_writer_cpu_seconds_total "):
                return float(line.split()[1])
    return 0.0


def _bootstrap_ci(diffs: list[float], level: float = 0.9, draws: int = 4000) -> list[float]:
    """A percentile bootstrap interval of the median of `diffs` (seeded: reproducible)."""
    rng = random.Random(11)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    lo = meds[int((1 - level) / 2 * draws)]
    hi = meds[int((1 + level) / 2 * draws) - 1]
    return [round(lo, 3), round(hi, 3)]


def warm_pairs(tokenizer: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The journal's cost with the machine's drift taken out: an engine and a server per
    mode, both started once and warmed, then `--warm-rounds` rounds of four short legs
    (off, on, on, off), each leg `--warm-turns` turns per agent on fresh sessions (left
    open). A leg lasts a second or two, so the two modes of a round run under the same
    machine state; the per-round difference (mean of its on legs minus mean of its off
    legs) is the paired sample, summarised by its median and a bootstrap interval. The
    journaling server's writer-process CPU (its own metric) is read around each leg too."""
    jdir = Path(tempfile.mkdtemp(prefix="tito-journal-", dir=root))
    legs: list[dict[str, Any]] = []
    lat: dict[bool, list[float]] = {False: [], True: []}
    try:
        with contextlib.ExitStack() as stack:
            urls: dict[bool, str] = {}
            for journal in (False, True):
                engine = stack.enter_context(sim_engine("sglang", tokenizer))
                extra = ["--journal-dir", str(jdir), "--instance-id", INSTANCE] if journal else []
                urls[journal] = stack.enter_context(server([engine], tokenizer, extra=extra))
            for journal in (False, True):
                asyncio.run(_phase(urls[journal], args.agents, args.warmup, args.max_tokens, kept=[]))
            for r in range(args.warm_rounds):
                for journal in (False, True, True, False):
                    url, pid = urls[journal], PIDS[urls[journal]]
                    leg_lat: list[float] = []
                    w0 = asyncio.run(_writer_cpu_s(url)) if journal else 0.0
                    cpu0, t0 = server_cpu_s(pid), time.monotonic()
                    n = asyncio.run(_phase(url, args.agents, args.warm_turns, args.max_tokens,
                                           latencies=leg_lat, kept=[]))
                    cpu, wall = server_cpu_s(pid) - cpu0, time.monotonic() - t0
                    writer = asyncio.run(_writer_cpu_s(url)) - w0 if journal else 0.0
                    lat[journal] += leg_lat
                    legs.append({"round": r, "journal": journal, "turns": n,
                                 "cpu_ms_per_turn": round(1000 * cpu / n, 3),
                                 "writer_cpu_ms_per_turn": round(1000 * writer / n, 4),
                                 "turns_per_s": round(n / wall, 1), "p99_ms": round(1000 * _pct(leg_lat, 0.99), 2)})
                print(json.dumps(legs[-4:]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(jdir, ignore_errors=True)

    def per_round(key: str, journal: bool, r: int) -> float:
        return statistics.fmean(x[key] for x in legs if x["round"] == r and x["journal"] == journal)

    rounds = range(args.warm_rounds)
    cpu_diffs = [per_round("cpu_ms_per_turn", True, r) - per_round("cpu_ms_per_turn", False, r) for r in rounds]
    p99_ratios = [per_round("p99_ms", True, r) / per_round("p99_ms", False, r) for r in rounds]
    on = [x for x in legs if x["journal"]]
    return {
        "rounds": args.warm_rounds, "turns_per_agent_per_leg": args.warm_turns, "legs": legs,
        "summary": {
            "cpu_ms_per_turn": {
                "off_median": round(statistics.median(x["cpu_ms_per_turn"] for x in legs if not x["journal"]), 3),
                "on_median": round(statistics.median(x["cpu_ms_per_turn"] for x in on), 3),
                "paired_round_diffs": [round(d, 3) for d in cpu_diffs],
                "median_paired_diff": round(statistics.median(cpu_diffs), 3),
                "median_paired_diff_ci90": _bootstrap_ci(cpu_diffs)},
            "writer_cpu_ms_per_turn_median": round(statistics.median(x["writer_cpu_ms_per_turn"] for x in on), 4),
            "p99_ms": {"off_pooled": round(1000 * _pct(lat[False], 0.99), 2),
                       "on_pooled": round(1000 * _pct(lat[True], 0.99), 2),
                       "on_over_off_pooled": round(_pct(lat[True], 0.99) / _pct(lat[False], 0.99), 3),
                       "paired_round_ratios": [round(x, 3) for x in p99_ratios],
                       "median_paired_ratio": round(statistics.median(p99_ratios), 3),
                       "median_paired_ratio_ci90": _bootstrap_ci(p99_ratios)},
            "p50_ms": {"off_pooled": round(1000 * _pct(lat[False], 0.50), 2),
                       "on_pooled": round(1000 * _pct(lat[True], 0.50), 2)},
        },
    }


# -- in-process: what one small turn's record costs ---------------------------------


async def _micro(path: Path, records: int, concurrency: int) -> dict[str, Any]:
    """The journal's own work for small turns, without the server: encoding a turn record
    (on the loop, as commit does), and appending `records` of them, `concurrency` at a time
    (the 64 agents' turns arrive together, so they share a sync), each awaited: CPU of this
    process (the loop's append and settle) and of the writer process (its SQLite work) per record."""
    rng, nprng = random.Random(3), np.random.default_rng(3)
    bodies = [_turn(rng, nprng, 1 + k % 8, 24, 8) for k in range(records)]
    t0 = time.process_time()
    for k in range(records):
        _turn(rng, nprng, 1 + k % 8, 24, 8)
    encode_us = 1e6 * (time.process_time() - t0) / records
    journal = Journal(path)
    journal.start(asyncio.get_running_loop())
    await journal.barrier()  # the writer process is up
    c0, w0, x0 = time.process_time(), time.monotonic(), journal.writer_cpu_s
    for i in range(0, records, concurrency):
        await asyncio.gather(*(journal.append(f"{INSTANCE}.{j % concurrency:032x}", TURN, b)
                               for j, b in enumerate(bodies[i:i + concurrency], i)))
    cpu = time.process_time() - c0 + journal.writer_cpu_s - x0
    wall = time.monotonic() - w0
    syncs = journal.syncs
    await journal.close()
    return {"records": records, "concurrency": concurrency, "body_bytes": len(bodies[0]),
            "encode_us_per_record": round(encode_us, 1),
            "append_cpu_us_per_record": round(1e6 * cpu / records, 1),
            "append_wall_us_per_record": round(1e6 * wall / records, 1), "syncs": syncs,
            "records_per_sync": round(records / max(1, syncs), 1)}


def micro(root: Path, records: int) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="tito-micro-", dir=root))
    try:
        return {"concurrent_64": asyncio.run(_micro(journal_path(d / "a", INSTANCE), records, 64)),
                "one_at_a_time": asyncio.run(_micro(journal_path(d / "b", INSTANCE), records // 8, 1))}
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- 4: recovery --------------------------------------------------------------------

_WORDS = ("the", "file", "test", "function", "returns", "error", "value", "list", "config", "path", "we",
          "should", "check", "output", "line", "call", "module", "import", "fix", "run", "next", "step")


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


def _turn(rng: random.Random, nprng: np.random.Generator, k: int, prompt_n: int, sampled_n: int) -> bytes:
    """One turn's record as commit writes it (an append after the first)."""
    ids = nprng.integers(0, 151_000, sampled_n, dtype=np.int32)
    lps = -nprng.exponential(0.5, sampled_n).astype(np.float32)
    user = {"role": "user", "content": _text(rng, 300)} if k == 0 else {
        "role": "tool", "tool_call_id": f"call_{k}", "content": _text(rng, 400)}
    reply = {"role": "assistant", "content": _text(rng, 350)}
    return turn_body(
        op="first" if k == 0 else "append", branch_id=0, checkpoint=k, reason=None, shared=None,
        tools=None, seq=k, prompt_ids=nprng.integers(0, 151_000, prompt_n, dtype=np.int32), ids=ids,
        logprobs=lps, repair=[151_645] if k % 4 == 3 else [], finish="stop", spans=None, version=3,
        request_messages=[user], assistant_message=reply, engine="http://127.0.0.1:30000", cached=0,
        extra={}, routed=None, answered=None, control=None, notes=[], recorded=None, matched_stop=None)


async def _write_journal(path: Path, sessions: int, turns: int, turn_tokens: int, batch: int) -> dict[str, Any]:
    """`sessions` sessions' create and turn records through the real writer process."""
    rng, nprng = random.Random(7), np.random.default_rng(7)
    journal = Journal(path)
    journal.start(asyncio.get_running_loop())
    expected: dict[str, int] = {}
    pending: list[asyncio.Future[None]] = []
    t0 = time.monotonic()
    body_bytes = 0
    for i in range(sessions):
        sid = f"{INSTANCE}.{i:032x}"
        s = Session(sid, SessionConfig(ttl_s=86_400.0, metadata={"task": f"t{i % 97}"}), 0.0)
        body = create_body(s)
        pending.append(journal.append(sid, CREATE, body))
        body_bytes += len(body)
        tokens = 0
        for k in range(turns):
            sampled_n = rng.randint(200, 400)
            prompt_n = max(1, turn_tokens - sampled_n + rng.randint(-50, 50))
            repair = 1 if k % 4 == 3 else 0
            body = _turn(rng, nprng, k, prompt_n, sampled_n)
            pending.append(journal.append(sid, TURN, body))
            body_bytes += len(body)
            tokens += prompt_n + sampled_n + repair
        expected[sid] = tokens
        if len(pending) >= batch:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    await journal.close()
    return {"write_s": round(time.monotonic() - t0, 2), "records": journal.records_written,
            "transactions": journal.syncs, "body_bytes": body_bytes, "expected": expected}


def _check(found: dict[str, int], expected: dict[str, int], sample: list[str]) -> dict[str, Any]:
    bad = [sid for sid in sample if found.get(sid) != expected[sid]]
    return {"sampled": len(sample), "token_mismatches": len(bad), "first_bad": bad[:3]}


def replay_in_process(path: Path, expected: dict[str, int], sample: list[str]) -> dict[str, Any]:
    gc.collect()
    t0 = time.monotonic()
    journal = Journal(path)
    rec = replay_rows(journal.read(), time.monotonic)
    elapsed = time.monotonic() - t0
    journal.release()
    found = {s.id: len(s.tree.active.trajectory) for s in rec.sessions if s.id in set(sample)}
    out = {"replay_s": round(elapsed, 2), "sessions": len(rec.sessions), "turns": rec.turns,
           "records": rec.records, **_check(found, expected, sample)}
    del rec
    gc.collect()
    return out


def _start(jdir: Path, tokenizer: str, engine: str, log: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """Spawn `serve` on `jdir` (no turns: the engine is only probed at start) and time it to /health 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [*CLI, "serve", "--tokenizer", tokenizer, "--port", str(port), "--log-level", "info",
            "--engine", engine, "--journal-dir", str(jdir), "--instance-id", INSTANCE]
    with log.open("wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        while time.monotonic() - t0 < 600:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return proc, url, time.monotonic() - t0
            time.sleep(0.02)
        raise TimeoutError("serve not healthy after 600 s")
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _sessions_gauge(url: str) -> int | None:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("tito_sessions "):
            return int(float(line.split()[-1]))
    return None


def serve_starts(jdir: Path, empty: Path, tokenizer: str, engine: str, expected: dict[str, int],
                 sample: list[str], starts: int) -> dict[str, Any]:
    """Spawn -> /health 200 on the full journal and on an empty one, alternating."""
    full_s: list[float] = []
    empty_s: list[float] = []
    logs: list[str] = []
    check: dict[str, Any] = {}
    for i in range(starts):
        for which, directory, times in (("empty", empty, empty_s), ("full", jdir, full_s)):
            log = directory.parent / f"serve-{which}-{i}.log"
            proc, url, took = _start(directory, tokenizer, engine, log)
            try:
                times.append(round(took, 2))
                if which == "full" and not check:
                    found = {}
                    for sid in sample:
                        r = httpx.get(f"{url}/sessions/{sid}", timeout=30)
                        found[sid] = r.json()["tokens"] if r.status_code == 200 else -r.status_code
                    check = {"sessions_gauge": _sessions_gauge(url), **_check(found, expected, sample)}
            finally:
                _stop(proc)
            if which == "full":
                logs += [ln for ln in log.read_text().splitlines() if "journal" in ln and "sessions" in ln]
            if which == "empty":  # the next start must find it empty again
                shutil.rmtree(empty)
                empty.mkdir()
    inside = [float(ln.rsplit(" in ", 1)[1].split()[0]) for ln in logs]
    return {"full_start_s": full_s, "empty_start_s": empty_s,
            "median_full_s": round(statistics.median(full_s), 2),
            "median_empty_s": round(statistics.median(empty_s), 2),
            "recovery_s": round(statistics.median(full_s) - statistics.median(empty_s), 2),
            "server_replay_s": inside, "server_log": logs, **check}


def recovery(tokenizer: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="tito-recovery-", dir=root))
    try:
        jdir, empty = base / "full", base / "empty"
        jdir.mkdir()
        empty.mkdir()
        path = journal_path(jdir, INSTANCE)
        wrote = asyncio.run(_write_journal(path, args.sessions, args.session_turns, args.turn_tokens, 1000))
        expected = wrote.pop("expected")
        sizes = journal_bytes(jdir)
        tokens = sum(expected.values())
        print(f"journal written: {wrote} {sizes}", file=sys.stderr, flush=True)
        sample = random.Random(1).sample(sorted(expected), min(50, len(expected)))
        in_process = replay_in_process(path, expected, sample)
        print(f"in-process replay: {in_process}", file=sys.stderr, flush=True)
        with sim_engine("sglang", tokenizer) as engine:
            started = serve_starts(jdir, empty, tokenizer, engine, expected, sample, args.starts)
        print(f"serve starts: {started}", file=sys.stderr, flush=True)
        return {"sessions": args.sessions, "turns_per_session": args.session_turns, "tokens": tokens,
                "tokens_per_session": round(tokens / len(expected)), **wrote, "files": sizes,
                "bytes_per_token": round((sizes["db"] + sizes["db_wal"]) / tokens, 2),
                "in_process": in_process, "serve": started}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--turns", type=int, default=20, help="measured turns per agent per leg")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="ABBA rounds (4 legs each)")
    ap.add_argument("--sessions", type=int, default=10_000, help="recovery: sessions in the journal")
    ap.add_argument("--session-turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=1024, help="recovery: ~new tokens per turn")
    ap.add_argument("--starts", type=int, default=2, help="recovery: serve starts per directory")
    ap.add_argument("--dir", type=Path, default=None, help="where the journals go (default: a temp dir on "
                    "the repository's disk)")
    ap.add_argument("--warm-rounds", type=int, default=0,
                    help="warm pairs: ABBA rounds of short legs on two servers started once (0: skip)")
    ap.add_argument("--warm-turns", type=int, default=12, help="warm pairs: turns per agent per leg")
    ap.add_argument("--skip-turns", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--micro-records", type=int, default=6400)
    ap.add_argument("--quick", action="store_true", help="a smoke run: everything shrunk")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.agents, args.warmup, args.turns, args.rounds = 8, 1, 3, 1
        args.warm_rounds, args.warm_turns = min(args.warm_rounds, 2), 3
        args.sessions, args.starts, args.micro_records = 200, 1, 640
    tokenizer = str(cached_tokenizer_dir(args.family))
    root = journal_root(args.dir)
    fs = filesystem(root)
    print(f"journals under {root}: {fs}", file=sys.stderr, flush=True)
    if fs["type"] == "tmpfs":
        print("warning: tmpfs: fsync costs nothing there", file=sys.stderr)
    result: dict[str, Any] = {
        "family": args.family, "agents": args.agents, "max_tokens": args.max_tokens, "turns_per_agent": args.turns,
        "warmup": args.warmup, "rounds": args.rounds, "filesystem": fs, "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg()}
    if not args.skip_turns:
        result["turns"] = turn_legs(tokenizer, root, args)
    if args.warm_rounds:
        result["warm_pairs"] = warm_pairs(tokenizer, root, args)
        print(f"warm pairs: {result['warm_pairs']['summary']}", file=sys.stderr, flush=True)
    if not args.skip_micro:
        result["micro"] = micro(root, args.micro_records)
        print(f"micro: {result['micro']}", file=sys.stderr, flush=True)
    if not args.skip_recovery:
        result["recovery"] = recovery(tokenizer, root, args)
    result["loadavg_end"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
