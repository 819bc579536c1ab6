"""What a new chat request means relative to a branch's committed messages.

An agent re-sends its whole conversation every turn. `reconcile` compares it
with the messages the branch already committed and returns a `Plan`: append
the new tail (the normal case), roll back to an earlier checkpoint (a retry),
or fork a fresh branch (the history was rewritten). Pure, O(messages); message
equality is injected, since what counts as "the same message" (content parts,
tool-call JSON, dropped ``reasoning_content``) is the codec's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trajectory.errors import InvariantError

Message = Mapping[str, Any]
PlanKind = Literal["first", "append", "rollback", "fork"]


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with a request: where to continue, and which messages are new."""

    kind: PlanKind
    checkpoint: int  # continue after this checkpoint of the branch (0 for first/fork)
    new_messages: list[Message] = field(default_factory=list)


def reconcile(
    history: Sequence[Message],
    checkpoint_message_counts: Sequence[int],
    request: Sequence[Message],
    equal: Callable[[Message, Message], bool],
) -> Plan:
    """Decide how `request` continues `history` (see rules below).

    `checkpoint_message_counts[k]` is how many messages of `history` precede
    checkpoint k (``[0, ..., len(history)]``, one per turn boundary), as given by
    `LinearTrajectory.checkpoint_message_counts`. `equal(committed, requested)`
    compares one history message with one request message.

    Rules, with ``m`` the length of the longest prefix of `request` equal to
    `history`:

    1. ``history`` empty: ``first`` at checkpoint 0; every request message is new.
    2. ``m == len(history)``: ``append`` at the last checkpoint; the new messages
       are ``request[m:]``.
    3. Otherwise the request diverges inside the history (a retry, or an edit):
       ``rollback`` to the latest checkpoint ``k >= 1`` with
       ``counts[k] <= m``; the new messages are ``request[counts[k]:]``.
    4. No such checkpoint (the first turn's messages differ, e.g. a rewritten
       system prompt, or the first turn is retried): ``fork`` at checkpoint 0;
       the whole request is new.

    An assistant message among the new messages is client-injected context (it
    is rendered as prompt, mask 0), including as the last message. The new
    messages may be empty (the request equals the history, or ends exactly at
    an earlier checkpoint); the caller decides what that means (nothing to
    generate for: the server answers 400).
    """
    counts = list(checkpoint_message_counts)
    if not counts or counts[0] != 0 or counts[-1] != len(history):
        raise InvariantError(
            f"checkpoint message counts {counts[:3]}... do not span a history of {len(history)} messages"
        )
    if any(b < a for a, b in zip(counts, counts[1:], strict=False)):
        raise InvariantError("checkpoint message counts must be non-decreasing")
    if not history:
        return Plan("first", 0, list(request))

    m = 0
    limit = min(len(history), len(request))
    while m < limit and equal(history[m], request[m]):
        m += 1
    if m == len(history):
        return Plan("append", len(counts) - 1, list(request[m:]))
    for k in range(len(counts) - 1, 0, -1):
        if counts[k] <= m:
            return Plan("rollback", k, list(request[counts[k] :]))
    return Plan("fork", 0, list(request))
