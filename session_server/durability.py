"""Durable sessions: the journal opened at start, replayed before the gate opens, fed.

With `journal_dir` set, a starting instance answers 503 `recovering` (on `/health` and
every session route) while a background task reads and replays its journal off the
loop (`journal_records.replay_rows`), puts the sessions back in the store, tells the
replay log which recorded request committed which turn (so an SDK retry of a turn
whose answer died with the process is answered from that turn, `Rerender`, never run
twice), gives the Responses dialect its stored objects, restores the trainer's weight
version; then the writer starts and the gate opens. A journal that fails its checks
stops the process (exit status 65) with the record named: serving from it would lose
data silently. Afterwards every removal from the store writes a tombstone (410).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from .api.dialects.openai_responses_output import StoredResponse
from .context import ServerContext
from .journal import JOURNAL_EXIT_STATUS, Journal, JournalCorrupt, journal_path
from .journal_records import INSTANCE, TOUCH, VERSION, encode, replay_rows
from .sessions import Session
from .settings import Settings
from .turn.replay import ReplayLog

__all__ = ["EXIT_ON_FATAL", "FATAL", "JOURNAL_EXIT_STATUS", "WRITER_DIED_STATUS", "open_journal", "recover",
           "stable_instance_id"]

_log = logging.getLogger("session_server")

FATAL: list[str] = []  # why the journal did not replay (the store stays closed: 503 recovering)
EXIT_ON_FATAL = [False]  # `serve` sets it: then the process exits (JOURNAL_EXIT_STATUS, WRITER_DIED_STATUS)

WRITER_DIED_STATUS = 70
"""A `serve` whose journal writer process died exits with this (sysexits' EX_SOFTWARE);
unlike `JOURNAL_EXIT_STATUS`, `cluster` restarts it: its journal replays."""

EXIT_DELAY_S = 0.5
"""After the writer died, how long `serve` lets the changes it failed answer 503 before exiting."""

_INSTANCE_FILE = "serve.instance"
_TOUCH_EVERY_S = 1.0


def stable_instance_id(directory: str, new_id: str) -> str:
    """The instance id a `serve` without `--instance-id` keeps across restarts when it
    journals: its sessions' ids begin with it, and its journal file is named by it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    f = d / _INSTANCE_FILE
    try:
        kept = f.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept
    f.write_text(new_id + "\n")
    return new_id


def open_journal(settings: Settings) -> Journal | None:
    if settings.journal_dir is None:
        return None
    return Journal(journal_path(settings.journal_dir, settings.instance_id), max_bytes=settings.journal_max_bytes,
                   tombstone_ttl_s=settings.tombstone_ttl_s, sync=settings.journal_sync)


async def recover(ctx: ServerContext, replays: ReplayLog) -> None:
    """Replay the journal into the store, then open the gate (see the module doc)."""
    journal, store = ctx.journal, ctx.store
    if journal is None:
        return
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        recovered = await ctx.offload.run(lambda: replay_rows(journal.read(), store.clock))
        responses = [(sid, body["rid"], msgspec.msgpack.decode(body["stored"], type=StoredResponse))
                     for sid, body in recovered.responses]
    except Exception as exc:  # JournalCorrupt, a record that does not rebuild: never served from
        _stop(f"the session journal does not replay: {exc}")
        return
    for s in recovered.sessions:
        store.restore(s)
    for sid, recorded, turn, matched_stop in recovered.answers:
        replays.restore(sid, recorded, turn, matched_stop)
    for sid, rid, stored in responses:
        owner = store.all().get(sid)
        if owner is not None:
            owner.responses[rid] = stored
    if recovered.orphans:
        _log.warning("journal %s: %d records of sessions already closed were skipped", journal.path,
                     recovered.orphans)
    try:
        journal.start(loop)
    except JournalCorrupt as exc:
        _stop(str(exc))
        return
    except OSError as exc:  # the writer process could not be started (out of processes, memory)
        _stop(f"the session journal's writer process could not be started: {exc}", WRITER_DIED_STATUS)
        return
    if recovered.weight_version is not None:
        ctx.control.restore_weight_version(recovered.weight_version)
    ctx.control.on_weight_version.append(lambda v: _keep_version(journal, v))
    journal.on_dead = _writer_died
    ctx.metrics.registry.register(_JournalCollector(journal))
    store.check_gone = journal.check_gone
    store.on_touch = lambda s: _touched(journal, s)
    store.on_remove.append(lambda s: _gone(journal, s))
    store.recovering = False
    _log.info("journal %s: %d sessions, %d turns from %d records in %.2f s", journal.path,
              len(recovered.sessions), recovered.turns, recovered.records, loop.time() - started)


class _JournalCollector(Collector):
    """The journal's own counters, read at scrape time (no work per record)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def collect(self) -> Iterator[Metric]:
        j = self.journal
        yield InfoMetricFamily("tito_journal", "How the journal syncs (--journal-sync)", value={"sync": j.sync})
        yield CounterMetricFamily("tito_journal_records", "Records the journal stored", value=j.records_written)
        yield CounterMetricFamily("tito_journal_syncs", "Journal transactions committed (each one sync under journal sync full)",
                                  value=j.syncs)
        yield CounterMetricFamily("tito_journal_failures", "Journal transactions that failed (nothing stored)",
                                  value=j.failures)
        yield CounterMetricFamily("tito_journal_writer_cpu_seconds",
                                  "CPU the journal's writer process has used (SQLite, the sync, reading the records)",
                                  value=j.writer_cpu_s)


def _touched(journal: Journal, s: Session) -> None:
    """A read pushed the session's TTL back: journaled (not waited for), at most once a
    second per session, so a session kept alive by reads alone keeps its deadline over a
    restart, within a second (recovery takes a session's last use from its newest record)."""
    now = s.last_used
    if now - s.journaled_use >= _TOUCH_EVERY_S:
        s.journaled_use = now
        journal.put(s.id, TOUCH, b"\x80")  # an empty msgpack map: the record's time is the point


def _keep_version(journal: Journal, version: int) -> None:
    """The trainer's weight version, kept as the instance's latest (labels after a restart)."""
    journal.put(INSTANCE, VERSION, encode({"version": version}))


def _gone(journal: Journal, s: Session) -> None:
    """The session left the store: its records go, its tombstone stays (410)."""
    journal.gone(s.id, s.gone_reason or "closed")


def _writer_died(why: str) -> None:
    """The journal's writer process died: this instance's sessions may now lack a change
    the file holds (sent, stored, never acknowledged), so it must not commit again
    before a replay. Under `serve`, end the process with `WRITER_DIED_STATUS`
    `EXIT_DELAY_S` later (its supervisor restarts it and the restart replays the
    journal, as after a crash);
    embedded, every change is refused and `/health` answers 503 `journal_down`."""
    _log.critical("the session journal's writer process died (%s): %s", why,
                  "exiting so that a restart replays the journal" if EXIT_ON_FATAL[0] else
                  "every change is refused until this instance restarts")
    if EXIT_ON_FATAL[0]:  # after the changes that waited for it have had their 503 written
        asyncio.get_running_loop().call_later(
            EXIT_DELAY_S, _exit, f"the session journal's writer process died ({why})", WRITER_DIED_STATUS)


def _stop(reason: str, status: int = JOURNAL_EXIT_STATUS) -> None:
    """Refuse to serve from a journal that does not replay (or cannot be written): under
    `serve`, end the process with `status` at once (nothing was written: the journal's
    writer starts after the replay; the reply decoder's processes die with their
    parent); embedded (tests, the demo), keep the store closed and say why in `FATAL`."""
    _log.critical("%s", reason)
    FATAL.append(reason)
    if EXIT_ON_FATAL[0]:
        _exit(reason, status)


def _exit(reason: str, status: int) -> None:
    logging.shutdown()
    print(f"session-server serve: error: {reason}", file=sys.stderr, flush=True)
    os._exit(status)
