"""What a committed turn leaves for the API edge: `TurnOutput` (the respond phase's
input) and `Rendered` (its bytes, kept by the replay log).

A leaf module on purpose: the stream events (`api/stream_events.py`), the live stream
(`live.py`), the replay log (`replay.py`) and the pipeline all name these values, and
none of them may import another just for a type (that was an import circle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Rendered", "TurnOutput", "committed_output"]


@dataclass(frozen=True)
class TurnOutput:
    """Everything the respond phase needs of a committed turn."""

    request_id: str
    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    sampled_ids: list[int]
    logprobs: list[float]
    top_logprobs: Sequence[Any] | None
    turn_index: int
    branch_id: int
    timings_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    matched_stop: int | str | None = None  # the engine's matched stop string or token id (Anthropic stop_sequence)


@dataclass(frozen=True)
class Rendered:
    """What the respond phase produced for one committed turn: a JSON body, or the SSE
    frames of a stream. Kept as bytes so that a replayed request (`replay.py`) gets
    exactly what the original got."""

    media_type: str
    body: bytes = b""
    frames: tuple[bytes, ...] | None = None  # set for a stream
    turn: tuple[int, int] | None = None  # the committed turn it answers (branch id, turn index)

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(f) for f in self.frames or ())


def committed_output(session: Any, turn: tuple[int, int], matched_stop: Any = None) -> TurnOutput:
    """A committed turn's `TurnOutput` rebuilt from the session's tree (a turn whose
    response was lost with a crash): what the respond phase needs, from its record and
    its tokens. No timings, no top logprobs (neither is stored with a turn)."""
    branch_id, index = turn
    traj = session.tree.get(branch_id).trajectory
    rec = traj.turn(index)
    ids, lps, _ = traj.arrays(rec.output_end)
    return TurnOutput(
        request_id=str(rec.extra.get("request_id", "")),
        message=dict(rec.assistant_message or {"role": "assistant", "content": ""}),
        finish_reason="stop" if rec.finish_reason == "repetition" else rec.finish_reason,
        prompt_tokens=rec.output_start,
        completion_tokens=rec.num_sampled,
        cached_tokens=rec.cached_tokens,
        sampled_ids=ids[rec.output_start:rec.output_end].tolist(),
        logprobs=lps[rec.output_start:rec.output_end].tolist(),
        top_logprobs=None,
        turn_index=index,
        branch_id=branch_id,
        matched_stop=matched_stop,
    )
