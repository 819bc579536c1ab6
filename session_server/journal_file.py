"""The journal's file: where it lives, how it is opened (WAL, the sync mode), and how
much of a torn write a crash left at the end of its WAL. The writing and reading is
`journal.py`'s; this is what they agree on about the file itself."""

from __future__ import annotations

import sqlite3
from pathlib import Path

__all__ = ["SYNC_MODES", "connect", "journal_path", "torn_tail"]

_WAL_HEADER, _FRAME_HEADER = 32, 24  # sqlite.org/fileformat.html, "The WAL file format"

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY, sid TEXT NOT NULL, kind TEXT NOT NULL, "
    "at REAL NOT NULL, body BLOB NOT NULL, crc INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS records_sid ON records (sid)",
    "CREATE TABLE IF NOT EXISTS tombstones (sid TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS tombstones_at ON tombstones (at)",
)


def journal_path(directory: str | Path, instance_id: str | None) -> Path:
    """The journal of this instance in `directory` (created when missing)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{instance_id or 'default'}.sqlite3"


SYNC_MODES = ("full", "normal")
"""SQLite's `synchronous` in WAL mode (sqlite.org/pragma.html#pragma_synchronous): `full`
syncs the WAL at every commit, so an acknowledged change survives the machine's crash or
power loss; `normal` syncs it only at checkpoints: SQLite keeps transactions across an
application's crash whatever the setting, so a killed process loses nothing
acknowledged, but a crashed machine may take back the last commits (a DELETE or a
samples `close` among them: the session comes back), never leaving the file
inconsistent. `off` is refused: an OS crash could corrupt the file."""


def connect(path: Path, max_bytes: int | None, sync: str = "full") -> sqlite3.Connection:
    """The journal opened in WAL mode with `sync` (one of `SYNC_MODES`), its tables made
    when missing; `max_bytes` a quota past which writes fail as on a full disk."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={sync.upper()}")
    if max_bytes is not None:  # a quota: past it, writes fail as on a full disk (SQLITE_FULL)
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={max(1, max_bytes // page)}")
    for stmt in _SCHEMA:
        conn.execute(stmt)
    return conn


def torn_tail(path: Path) -> int:
    """Bytes of an unfinished frame at the end of the WAL (0: none, or no WAL)."""
    wal = path.with_name(path.name + "-wal")
    try:
        size = wal.stat().st_size
        with wal.open("rb") as f:
            header = f.read(_WAL_HEADER)
    except FileNotFoundError:
        return 0
    if size <= _WAL_HEADER or len(header) < _WAL_HEADER:
        return max(0, size) if 0 < size < _WAL_HEADER else 0
    page = int.from_bytes(header[8:12], "big")
    page = 65536 if page == 1 else page
    if page < 512:
        return 0
    return (size - _WAL_HEADER) % (page + _FRAME_HEADER)
