"""What a training sample records per turn, beside its tokens: the turn's diagnostics
and the weight version of each sampled token (`trajectory.samples` builds the sample;
these read one line's `TurnRecord`s). Apart so the sample builder stays one readable
module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from trajectory.turn_record import TurnRecord, WeightVersion

__all__ = ["turn_diagnostics", "weight_versions"]


def turn_diagnostics(turn: TurnRecord, owner: int) -> dict[str, Any]:
    """What the trajectory records about how a turn's tokens came about.

    ``history_rewrite`` is the turn's ``extra["history_rewrite"]`` when the
    server recorded one: the template would re-render an earlier turn once this
    turn's messages follow it, and the committed tokens were kept (the
    ``append`` policy); ``{"rewritten_turn": i, "first_diff": position}`` with the
    absolute position of the first token a re-render changes (None when the
    change is in the turn's closing tokens). ``tool_call_id_renames`` maps the
    ids the client re-sent the previous turn's tool calls under to ours.
    ``repair_tokens`` counts the closing tokens the server appended (mask 0);
    ``parse_status`` and ``parse_detail`` say how the output parsed.
    ``stale_bound`` is set when the turn was ended at a weight update by its
    ``max_weight_lag`` (finish ``abort``): ``{"max_weight_lag", "versions",
    "next_version"}``. ``sampling`` is how the turn was sampled, when the server
    recorded it: ``{"policy", "engine", "client", "overridden", "seeds"}`` (the values
    the engine was sent, the values the client sent, the client's that did not reach
    the engine, and the seed each segment was sent).
    """
    extra = turn.extra
    return {
        "turn": turn.index,
        "branch": owner,
        "seq": turn.seq,  # what a per-turn reward names it by (`trajectory.turn_rewards`)
        "finish_reason": turn.finish_reason,
        "repair_tokens": turn.repair_tokens,
        "parse_status": extra.get("parse_status"),
        "parse_detail": extra.get("parse_detail"),
        "history_rewrite": extra.get("history_rewrite"),
        "tool_call_id_renames": extra.get("tool_call_id_renames"),
        "stale_bound": extra.get("stale_bound"),
        "sampling": extra.get("sampling"),
    }


def _version_key(v: WeightVersion) -> tuple[type, Any]:
    return (type(v), v)  # 1 and 1.0 are different versions


def weight_versions(turns: Sequence[TurnRecord], n: int) -> tuple[np.ndarray, list[WeightVersion]]:
    """Per-token index into a table of versions in order of first use (-1: none)."""
    index = np.full(n, -1, dtype=np.int32)
    table: list[WeightVersion] = []
    seen: dict[tuple[type, Any], int] = {}
    for t in turns:
        for start, end, version in t.weight_spans:
            if version is None:
                continue
            key = _version_key(version)
            j = seen.setdefault(key, len(table))
            if j == len(table):
                table.append(version)
            index[start:end] = j
    return index, table
