"""The shell commands the README and `docs/` show, read from the files themselves, so a
test runs (or parses) exactly what a user would paste."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([A-Za-z]*)[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is and its text."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path, langs: tuple[str, ...] | None = SHELL_LANGS) -> list[Block]:
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        if langs is None or m.group(1) in langs:
            out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)))
    return out


def shell_block(containing: str, path: Path = ROOT / "README.md") -> str:
    """The one shell block of `path` that contains `containing`, as written."""
    found = [b.text for b in blocks(path) if containing in b.text]
    assert len(found) == 1, f"{path.name}: {len(found)} shell blocks contain {containing!r}"
    return found[0]
