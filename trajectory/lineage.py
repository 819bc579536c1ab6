"""Which agent and thread a turn came from: `Lineage`, the per-turn label.

A harness runs sub-agents and side requests inside one session (Claude Code's Agent
tool, Codex's spawned threads): their turns land on branches of the same tree, and a
trainer that wants only the main agent's turns, or one sub-agent's, needs each turn
labelled with who asked for it. The server derives the label from what the client
sends (`session_server/api/lineage.py`); this module is only the value and its plain
form, so export, samples and the journal carry it without knowing HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["KINDS", "AgentFilter", "Lineage", "lineage_from_dict"]

KINDS = ("main", "subagent", "side")
"""main: the harness's own loop; subagent: an agent it spawned; side: a one-off request
(a title, a summary, a compaction) that is no agent's loop."""


@dataclass(frozen=True, slots=True)
class Lineage:
    agent: str  # the agent's name as the client gave it ("main" when it names none)
    kind: str  # one of KINDS
    thread: str | None = None  # the client's id for the conversation the turn continues
    parent: str | None = None  # the thread (or session) that spawned it, when the client says
    source: str = ""  # the header or body field the label was read from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lineage_from_dict(d: Mapping[str, Any] | None) -> Lineage | None:
    """The inverse of `Lineage.to_dict` (None stays None): a stored label read back."""
    if d is None:
        return None
    if not isinstance(d, Mapping) or not isinstance(d.get("agent"), str) or d.get("kind") not in KINDS:
        raise ValueError(f"not a lineage: {d!r}")
    for k in ("thread", "parent"):
        if d.get(k) is not None and not isinstance(d[k], str):
            raise ValueError(f"lineage {k} must be a str or null, got {d[k]!r}")
    return Lineage(agent=d["agent"], kind=d["kind"], thread=d.get("thread"), parent=d.get("parent"),
                   source=str(d.get("source") or ""))


@dataclass(frozen=True, slots=True)
class AgentFilter:
    """Which turns a trainer asked for by lineage (`build_samples(agent=...)`): an agent's
    name, a kind, or both (both must match). A turn the client labelled nothing
    (lineage None) matches no filter: who asked for it is unknown."""

    agent: str | None = None
    kind: str | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"agent_kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.agent is not None and (not isinstance(self.agent, str) or not self.agent):
            raise ValueError(f"agent must be a non-empty str, got {self.agent!r}")

    @property
    def active(self) -> bool:
        return self.agent is not None or self.kind is not None

    def matches(self, lineage: Lineage | None) -> bool:
        if not self.active:
            return True
        return lineage is not None and self.agent in (None, lineage.agent) and self.kind in (None, lineage.kind)
