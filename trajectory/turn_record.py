"""What one committed turn is: `TurnRecord` and the weight-version types it carries.

Kept apart from `trajectory.linear` (which owns how turns are appended, rolled back
and shared between branches) because every reader of a trajectory needs the record,
while only the line itself writes it: export, samples and the tree import this
small module's vocabulary. `trajectory.linear` re-exports the names, where RL workers
have always imported them.

Layout of one turn inside the token stream::

    prompt_start      output_start       output_end     end
    |-- prompt (mask 0) --|-- sampled (mask 1) --|-- repair (mask 0) --|

``repair`` holds the end-of-turn tokens the server appended because the model
stopped without sampling them (finish ``length``/``abort``/stop string), so the
next turn's prompt can follow a closed assistant turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trajectory.lineage import Lineage
from trajectory.routed import RoutedRows
from trajectory.support import SupportCSR

Message = Mapping[str, Any]
WeightVersion = str | int | float | None
WeightSpan = tuple[int, int, WeightVersion]


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One committed generation and where its tokens lie (absolute positions)."""

    index: int
    prompt_start: int
    output_start: int
    output_end: int  # end of the sampled ids
    end: int  # after the repair tokens; equals the next checkpoint
    finish_reason: str
    # (start, end, version) covering [output_start, output_end) exactly
    weight_spans: tuple[WeightSpan, ...]
    engine: str | None = None
    cached_tokens: int = 0
    repair_tokens: int = 0  # mask-0 closing tokens appended after the sampled ids
    request_messages: tuple[Message, ...] = ()  # the new messages this turn added
    assistant_message: Message | None = None  # what we returned to the agent
    extra: dict[str, Any] = field(default_factory=dict)
    # commit order across a session's branches (the tree's clock; the turn index
    # when committed outside a tree): what "later" means when picking samples
    seq: int = -1
    # routing replay (trajectory.routed): rows for positions [start, output_end - 1)
    routed_experts: RoutedRows | None = field(default=None, compare=False, repr=False)
    # which agent and thread asked for it (trajectory.lineage); None: the client said nothing
    lineage: Lineage | None = None
    # sampling support (trajectory.support): one row per sampled id, when the session asked
    sampling_support: SupportCSR | None = field(default=None, compare=False, repr=False)

    @property
    def weight_version(self) -> WeightVersion:
        """Version of the last sampled span (the one that finished the turn)."""
        return self.weight_spans[-1][2] if self.weight_spans else None

    @property
    def num_sampled(self) -> int:
        return self.output_end - self.output_start


def shared_extra(extra: Mapping[str, Any] | None, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """A new turn's `extra`, as its own dict, with each container value that is exactly the
    previous turn's under the same key (`_same`) replaced by that turn's object. An
    episode's turns mostly carry the same sampling record: one dict shared by them is one
    object the cyclic GC scans instead of three per turn (a dict and its two lists), on
    every full pass for the episode's life (bench/gc_pauses.py). Records are read-only:
    a shared value must never be changed in place (copy it to edit it)."""
    out = dict(extra) if extra else {}
    if previous:
        for key, value in out.items():
            before = previous.get(key)
            if type(value) in (dict, list) and before is not value:
                try:
                    if _same(value, before):
                        out[key] = before
                except RecursionError:  # a value that holds itself: kept as given
                    pass
    return out


_ATOMS = (str, int, bool, type(None))


def _same(a: Any, b: Any) -> bool:
    """Equal with the same type at every level (no 1 for 1.0 or True, no subclass for its
    base), dicts in the same key order, floats to the sign of zero; anything but plain
    JSON-like values (an array, an enum, an object) is never the same."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        return len(a) == len(b) and all(type(x) is type(y) and x == y and _same(a[x], b[y]) for x, y in zip(a, b, strict=True))
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    if kind is float:
        return bool(a == b) and (a != 0.0 or str(a) == str(b))
    return kind in _ATOMS and bool(a == b)
