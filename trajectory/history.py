"""What a new chat request means relative to a branch's committed messages.

An agent re-sends its whole conversation every turn. `reconcile` compares it
with the messages the branch already committed and returns a `Plan`: append
the new tail (the normal case), roll back to an earlier checkpoint (a retry),
or fork a fresh branch (the history was rewritten). Pure, O(messages); message
equality is injected, since what counts as "the same message" (content parts,
tool-call JSON, dropped ``reasoning_content``) is the codec's business.

`attach` is the same decision over a whole tree (any line, not only the active one):
the session server uses it; `reconcile` serves a worker that keeps one linear line.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trajectory.errors import InvariantError
from trajectory.messages import match_returned, messages_equal
from trajectory.sent_forms import form_digest
from trajectory.tree import (
    FIRST_TURN_RESENT,
    HISTORY_EDITED,
    LEGACY_FORK_REASON,
    NEW_CONVERSATION,
    SIDE_REQUEST,
    SUBAGENT,
    TEMPLATE_REWRITE,
    Branch,
    TrajectoryTree,
)
from trajectory.turn_record import TurnRecord

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


@dataclass(frozen=True, slots=True)
class Attachment:
    """Where in a whole tree a request continues (see `attach`)."""

    kind: PlanKind  # first | append | rollback | fork
    branch_id: int  # append: the branch extended; rollback/fork: the branch forked from
    checkpoint: int  # the node: this checkpoint of the branch's line (0 for first/fork)
    new_messages: list[Message] = field(default_factory=list)
    renames: dict[str, Any] = field(default_factory=dict)  # client tool-call id -> ours (last turn)
    # rollback/fork: (branch, message index) where the request first differs from the
    # line it matched furthest (a diagnostic names why, e.g. inlined reasoning)
    diverged: tuple[int, int] | None = None
    # fork: what the request is to the line it matched furthest (`NEW_CONVERSATION`,
    # `HISTORY_EDITED` or `FIRST_TURN_RESENT`, see `_opening`); None otherwise
    opening: str | None = None


def _is_returned(traj: Any, counts: Sequence[int], i: int) -> bool:
    """Whether message `i` of a line is an assistant message we returned: the last
    message of a turn that has one (O(log turns))."""
    k = bisect_left(counts, i + 1)
    return k < len(counts) and counts[k] == i + 1 and traj.turn(k - 1).assistant_message is not None


def _match_line(traj: Any, counts: Sequence[int], request: Sequence[Message], start: int) -> int:
    """How far `request` equals the line's messages, comparing from `start` on. A message
    sent before in the same exact form matches by its digest (`sent_forms`); only the
    others are compared field by field, and their digests kept once they match."""
    m = start
    limit = min(traj.num_messages, len(request))
    known = traj.sent_forms
    while m < limit:
        sent = request[m]
        digest = form_digest(sent)
        if digest is not None and known.matches(m, digest):
            m += 1
            continue
        committed = traj.message(m)
        if _is_returned(traj, counts, m):
            same = match_returned(committed, sent) is not None
        else:
            same = messages_equal(committed, sent)
        if not same:
            break
        if digest is not None:
            known.note(m, digest)
        m += 1
    return m


def attach(tree: TrajectoryTree, request: Sequence[Message]) -> Attachment:
    """Attach `request` at the deepest node of `tree` whose message path prefixes it.

    An agent re-sends its whole conversation; the conversation may continue any
    line of the tree, not only the active branch: a main agent resumes after a
    sub-agent ran on another branch, or goes back to a line it left. For every
    branch, the request is matched against the branch's line (assistant messages
    we returned match by content and calls, whatever the tool-call ids; anything
    else as `messages_equal`); the node is the latest checkpoint whose messages
    all match. The deepest node wins (ties: the line's end, so nothing forks
    needlessly; then the active branch; then the newest):

    * the tree holds no turn: ``first`` on the active branch;
    * the node is the end of a branch's line: ``append`` to that branch;
    * the node is inside a line: ``rollback`` (a new branch from that checkpoint);
    * nothing past the root matches: ``fork`` (a new branch from checkpoint 0),
      with the whole request new.

    Cost: a branch's line shares its prefix with its parent's, so the prefix's
    result is reused and only the branch's own messages are compared, up to the
    first difference: O(the matched path + branches), not O(branches x history).
    `renames` maps the client's tool-call ids to ours for the last matched turn's
    assistant message (earlier turns reported theirs when they were matched first).
    """
    if all(b.trajectory.num_turns == 0 for b in tree.branches()):
        return Attachment("first", tree.active_id, 0, list(request))
    matched: dict[int, int] = {}
    best: tuple[int, int, int, int] | None = None  # (messages, at_end, is_active, id)
    best_k = 0
    for b in sorted(tree.branches(), key=lambda x: x.id):  # parents before children
        traj = b.trajectory
        counts = traj.message_counts_view()  # no copy: O(1) per branch
        shared = counts[b.fork_checkpoint]
        inherited = 0 if b.parent_id is None else matched[b.parent_id]
        if inherited < shared:
            m = inherited  # diverged before the fork point: same result as the parent's line
        else:
            m = _match_line(traj, counts, request, shared)
        matched[b.id] = m
        k = bisect_right(counts, m) - 1  # the latest checkpoint whose messages all match
        if k == 0:
            continue
        key = (counts[k], int(k == traj.num_turns), int(b.id == tree.active_id), b.id)
        if best is None or key > best:
            best, best_k = key, k
    if best is None:
        far = max(tree.branches(), key=lambda b: (matched[b.id], b.id == tree.active_id, b.id))
        return Attachment("fork", tree.active_id, 0, list(request),
                          diverged=_diverged(far.trajectory, far.id, matched[far.id], request),
                          opening=_opening(far.trajectory, matched[far.id]))
    branch = tree.get(best[3])
    traj = branch.trajectory
    counts = traj.message_counts_view()
    new = list(request[counts[best_k] :])
    last = traj.turn(best_k - 1).assistant_message
    renames = {}
    if last is not None:
        renames = match_returned(last, request[counts[best_k] - 1]) or {}
    kind: PlanKind = "append" if best_k == traj.num_turns else "rollback"
    diverged = _diverged(traj, branch.id, matched[branch.id], request) if kind == "rollback" else None
    return Attachment(kind, branch.id, best_k, new, renames, diverged)


def _diverged(traj: Any, branch_id: int, m: int, request: Sequence[Message]) -> tuple[int, int] | None:
    """(branch, m) when message m of the line and of the request both exist (they differ)."""
    return (branch_id, m) if m < min(traj.num_messages, len(request)) else None


def _opening(traj: Any, m: int) -> str:
    """What a request that forks from the root is to the line it matched furthest, `m`
    messages in: nothing in common (a new conversation), the line's whole first-turn
    input again (turn 0 resent: what a rollback is to a later turn), or a first turn
    that starts alike and then differs (an edited or compacted history)."""
    if m == 0 or traj.num_turns == 0:
        return NEW_CONVERSATION
    first = traj.message_counts_view()[1]  # turn 0's messages, its answer included
    inputs = first - (1 if traj.turn(0).assistant_message is not None else 0)
    return FIRST_TURN_RESENT if m >= inputs else HISTORY_EDITED


def fork_reason(a: Attachment, lineage_kind: str | None) -> str:
    """The reason of the branch a root fork opens: what its lineage says the request is,
    when it says a side request or a sub-agent, else what it is to the tree (`opening`)."""
    if lineage_kind == "side":
        return SIDE_REQUEST
    if lineage_kind == "subagent":
        return SUBAGENT
    return a.opening or NEW_CONVERSATION


def fork_reason_now(reason: str, before: list[Branch], parent_id: int | None, fork_index: int,
                    own: Sequence[TurnRecord]) -> str:
    """An imported branch's `reason`, the old single word `LEGACY_FORK_REASON` read as
    journal replay reads it (session_server/journal_records.py): a branch that shares
    tokens with its parent is a template's fork; a root fork is named by its first
    turn's lineage, else by attaching that turn's request to the branches `before` it
    (ids grow with commits: the tree it forked from, best effort as replay is, since a
    concurrent request's branch committed first may be among them). A root fork with no
    turn of its own cannot be decided and keeps the old word; other words are kept."""
    if reason != LEGACY_FORK_REASON or parent_id is None:
        return reason
    if fork_index > 0:
        return TEMPLATE_REWRITE
    if not own:
        return LEGACY_FORK_REASON
    first = own[0]
    tree = TrajectoryTree.from_branches(before, parent_id)
    return fork_reason(attach(tree, first.request_messages), None if first.lineage is None else first.lineage.kind)
