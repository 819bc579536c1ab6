"""The pieces every streamed tool-call reader shares (Hermes JSON in `incremental.py`,
GLM XML in `incremental_glm.py`): what a reader emits and the marker-suffix test that
holds back text which may still become a marker. Apart from both readers so that
neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["CallArgs", "CallReader", "CallStart", "partial_marker"]


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class CallStart:
    """Tool call `index` begins: its name is complete, offered, and the arguments object opened."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArgs:
    """More canonical (`json.dumps`) text of tool call `index`'s arguments."""

    index: int
    text: str


class CallReader(Protocol):
    """What reads a family's tool calls from the text `FieldSplitter.take` hands over."""

    def feed(self, text: str) -> list[CallStart | CallArgs]: ...
