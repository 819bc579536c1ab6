"""Prepare and render: the phases that decide what a turn adds to its session.

`prepare` runs under the session lock, offloaded (O(messages) + one memcpy): it
reconciles the request's messages with the committed history (append, rollback or
fork), snapshots the context, and derives the request's constraint. `render_prompt` turns
the new messages into prompt tokens (O(new tokens)). Both return frozen values.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from trajectory.codec.base import BridgeRefusal, HistoryPolicy, Message, RefusalReason
from trajectory.history import attach, fork_reason
from trajectory.messages import inlined_reasoning
from trajectory.tree import TEMPLATE_REWRITE, TrajectoryTree

from ..context import ServerContext
from ..errors import BadRequest, BranchLimit, HistoryMismatch
from ..offload import INLINE_BYTES
from ..sessions import Session
from ..structured import Constraint, request_constraint
from .chat_request import ChatRequest

__all__ = ["Prepared", "Prompt", "check_branch_cap", "client_messages", "last_weight_version", "prepare", "render_prompt"]

_TAIL_TOKENS = 16


@dataclass(frozen=True)
class Prepared:
    """What prepare decided and snapshotted under the lock."""

    kind: str  # first | append | rollback | fork
    branch_id: int
    base_len: int  # length of branch `branch_id` at prepare (checked again at commit)
    checkpoint: int  # rollback target (0 otherwise)
    context_ids: np.ndarray  # committed ids kept as context (int32 copy)
    history: list[Message]
    tail: list[int]
    new_messages: list[Message]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    last_weight_version: Any
    constraint: Constraint | None = None  # tool_choice / response_format, derived off the loop
    fork_reason: str | None = None  # why a fork was decided (prepare or render; diagnostic at commit)
    fork_detail: str | None = None  # the codec's words for a fork decided at render
    # a fork from the root with no known cause: the new branch's reason, what the request
    # is (`trajectory.history.fork_reason`: new conversation, turn 0 resent, ...); not noted
    opening: str | None = None
    tool_call_renames: dict[str, Any] = field(default_factory=dict)  # client id -> ours (10.2)
    prev_output: tuple[int, int, int] | None = None  # (turn index, output_start, output_end) before the node
    history_rewrite: dict[str, Any] | None = None  # set by render: where a re-render would differ
    # the kept line's fork points, for a fork render decides (O(turns), see `_fork_point`):
    # per checkpoint up to `checkpoint`, its token position and its message count; per
    # turn before it, where its sampled tokens start (a fork may share its prompt)
    line_checkpoints: tuple[int, ...] = (0,)
    line_message_counts: tuple[int, ...] = (0,)
    line_output_starts: tuple[int, ...] = ()
    fork_shared: int | None = None  # a fork's tokens shared with its parent (None: the checkpoint's)
    # the commit order (`TurnRecord.seq`) of the last committed turn whose answer the
    # request's history holds, as attached before any fork: the client had that answer
    # (replay.py never replays it to a later identical request; `Session.built_on`)
    answered: int | None = None


@dataclass(frozen=True)
class Prompt:
    """The new prompt tokens, and the prepared state they belong to: `prep` itself, or a
    new value when the template policy turned the turn into a fork."""

    prompt_ids: list[int]
    prep: Prepared


def client_messages(messages: Sequence[dict[str, Any]], developer_role: bool) -> list[dict[str, Any]]:
    """The messages as the client sent them, which are rendered and stored
    (they are only *compared* in normal form). One rule for `developer`: a
    template without that role gets it as `system`, on turn 0 and every later turn."""
    if developer_role:
        return list(messages)
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def prepare(ctx: ServerContext, session: Session, req: ChatRequest) -> Prepared:
    """Decide where the request attaches in the session's tree (append, rollback or
    fork) and snapshot what render and commit need."""
    tree = session.tree
    codec = ctx.codec
    request_msgs = client_messages(req.messages, codec.developer_role)
    plan = attach(tree, request_msgs)  # compared in normal form, anywhere in the tree
    branch = tree.get(plan.branch_id)
    traj = branch.trajectory
    counts = traj.message_counts_view()
    kind, checkpoint, new = plan.kind, plan.checkpoint, list(plan.new_messages)
    matched = traj.num_turns if kind == "append" else (checkpoint if kind == "rollback" else 0)
    answered = traj.turn(matched - 1).seq if matched >= 1 else None
    tools = req.tools or None
    kwargs = {**session.config.chat_template_kwargs, **(req.chat_template_kwargs or {})}
    fork_reason: str | None = None
    fork_detail: str | None = None
    if kind in ("append", "rollback") and not codec.same_tools(
        session.tools_by_branch.get(branch.id), tools, template_kwargs=kwargs
    ):
        # the tools render into the system prompt: the committed prefix no longer is
        # what the model would see, so the whole request starts a new branch (16.1)
        kind, checkpoint, new = "fork", 0, list[Message](request_msgs)
        fork_reason = "tools_changed"
    if fork_reason is None and kind in ("rollback", "fork") and plan.diverged is not None:
        fork_reason, fork_detail = _divergence_cause(tree, plan.diverged, request_msgs)
    if kind in ("append", "rollback") and not new:
        raise BadRequest("no new message after the committed history: nothing to respond to")
    if kind == "append":
        keep = len(traj)
    elif kind == "rollback":
        keep = traj.checkpoints[checkpoint]
    else:
        keep, checkpoint = 0, 0
    hist = [traj.message(i) for i in range(counts[checkpoint])] if keep else []
    context_ids = np.array(traj.ids_until(keep), dtype=np.int32, copy=True)
    return Prepared(
        kind=kind,
        branch_id=branch.id,
        base_len=len(traj),
        checkpoint=checkpoint,
        context_ids=context_ids,
        history=hist,
        tail=[int(x) for x in context_ids[-_TAIL_TOKENS:]],
        new_messages=new,
        tools=tools,
        template_kwargs=kwargs,
        last_weight_version=ctx.control.version_floor(last_weight_version(tree)),
        # proportional to the client's schemas: derived here, off the event loop
        constraint=request_constraint(req, ctx.codec.family),
        fork_reason=fork_reason,
        fork_detail=fork_detail,
        opening=fork_reason_of(plan, req) if plan.kind == "fork" else None,
        tool_call_renames=dict(plan.renames) if kind in ("append", "rollback") else {},
        prev_output=_prev_output(traj, checkpoint) if keep else None,
        line_checkpoints=tuple(traj.checkpoints[: checkpoint + 1]) if keep else (0,),
        line_message_counts=tuple(counts[: checkpoint + 1]) if keep else (0,),
        line_output_starts=tuple(traj.turn(i).output_start for i in range(checkpoint)) if keep else (),
        answered=answered,
    )


def fork_reason_of(plan: Any, req: ChatRequest) -> str:
    """A root fork's branch reason from the attachment and the request's lineage."""
    lineage = req._lineage
    return fork_reason(plan, None if lineage is None else lineage.kind)


def _divergence_cause(tree: TrajectoryTree, at: tuple[int, int],
                      request: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """Why the request left the line it matched furthest, when a known client habit
    explains it (noted with the new branch at commit); else (None, None)."""
    branch_id, i = at
    if inlined_reasoning(tree.get(branch_id).trajectory.message(i), request[i]):
        return "inlined_reasoning", (
            f"message {i} is the assistant message returned on branch {branch_id} with its reasoning "
            "inlined in content as <think>...</think>; it was returned in reasoning_content, so the "
            "message differs from what was committed: send reasoning_content back as returned (or drop it)")
    return None, None


def _prev_output(traj: Any, checkpoint: int) -> tuple[int, int, int] | None:
    if checkpoint < 1:
        return None
    t = traj.turn(checkpoint - 1)
    return (t.index, t.output_start, t.output_end)


def last_weight_version(tree: TrajectoryTree) -> Any:
    """The weight version of the session's last sampled token, on any branch (the
    turn with the highest commit seq that sampled anything; None: none known)."""
    best: tuple[int, Any] | None = None
    for b in tree.branches():
        traj = b.trajectory
        for i in range(traj.num_turns - 1, b.fork_checkpoint - 1, -1):  # own turns, newest first
            t = traj.turn(i)
            if t.weight_spans:
                if best is None or t.seq > best[0]:
                    best = (t.seq, t.weight_spans[-1][2])
                break
    return None if best is None else best[1]


async def render_prompt(ctx: ServerContext, session: Session, prep: Prepared, *, note: bool = True) -> Prompt:
    """The new prompt tokens: the whole render at turn 0 or a fork, else only the delta.
    `note=False` (a token count, not a turn): the session's diagnostics stay untouched."""
    codec = ctx.codec
    session_note = session.note if note else _no_note
    if prep.kind in ("first", "fork"):
        ids = await ctx.offload.run_sized(
            _inline_size(_render_size(prep.new_messages, prep.tools)),
            codec.render_first, prep.new_messages, tools=prep.tools, template_kwargs=prep.template_kwargs
        )
        return Prompt(list(ids), prep)
    template = session.config.history_policy is HistoryPolicy.TEMPLATE
    # APPEND renders the last turn and the new messages (with the tools): small ones on
    # the loop (`RENDER_INLINE_CHARS`); TEMPLATE reads the whole context
    size = INLINE_BYTES if template else _inline_size(
        _render_size([*prep.history[-1:], *prep.new_messages], prep.tools))
    result = await ctx.offload.run_sized(
        size,
        codec.bridge,
        prep.history,
        prep.tail,
        prep.new_messages,
        tools=prep.tools,
        template_kwargs=prep.template_kwargs,
        policy=session.config.history_policy,
        # TEMPLATE is exact by definition: the codec compares every committed id with
        # the full re-render (O(context), in the pool); APPEND stays O(new tokens)
        # (the int32 array itself: the codec reads it in the pool, no copy on the loop)
        committed=cast("Sequence[int]", prep.context_ids) if template else None,
    )
    if isinstance(result, BridgeRefusal):
        if (session.config.history_policy is HistoryPolicy.TEMPLATE
                or result.reason is RefusalReason.ROLE_MISMATCH):
            # follow the template: a new branch equal to its render of the whole request,
            # sharing with this one everything before the first token that render changes
            # (`_fork_point`). A role mismatch forks under `append` too: no delta after the
            # sampled role token is what the template renders, and the sampled token is
            # never rewritten (the branch holding it stays as it is). Noted at commit.
            full: list[Message] = [*prep.history, *prep.new_messages]
            ids, k, shared = await ctx.offload.run(_rewrite_fork, codec, prep, full)
            forked = replace(prep, kind="fork", checkpoint=k, fork_shared=shared,
                             new_messages=full[prep.line_message_counts[k]:],
                             context_ids=prep.context_ids[:shared], tail=[int(x) for x in prep.context_ids[:shared][-_TAIL_TOKENS:]],
                             history=list(prep.history[: prep.line_message_counts[k]]), prev_output=None,
                             fork_reason=_template_fork(result.reason), fork_detail=result.detail)
            return Prompt(ids[shared:], forked)
        raise HistoryMismatch(
            f"cannot prove the committed tokens stay a prefix ({result.reason.value}: {result.detail}); "
            "create the session with history_policy='template' to fork instead"
        )
    if result.rewrites_history:
        rewrite = _history_rewrite(prep, result.rewrite_offset)
        session_note("history_rewrite", detail="template would re-render earlier turns; kept what the model saw",
                     **rewrite)
        return Prompt(list(result.prompt_ids), replace(prep, history_rewrite=rewrite))
    return Prompt(list(result.prompt_ids), prep)


def _template_fork(reason: RefusalReason) -> str:
    """The reason of a fork the codec's refusal decides: the refusal's own word, except
    that a template's history rewrite is `template_rewrite` as a branch (under `append`
    the same event is the turn's `history_rewrite` diagnostic, and no branch)."""
    return TEMPLATE_REWRITE if reason is RefusalReason.HISTORY_REWRITE else reason.value


def _rewrite_fork(codec: Any, prep: Prepared, full: list[Message]) -> tuple[list[int], int, int]:
    """The template's render of the whole request and where the fork leaves the kept line
    (offloaded: O(context), as the `template` policy's exact check already is)."""
    ids = list(codec.render_first(full, tools=prep.tools, template_kwargs=prep.template_kwargs))
    k, shared = _fork_point(prep, ids)
    return ids, k, shared


def _fork_point(prep: Prepared, full: Sequence[int]) -> tuple[int, int]:
    """(checkpoint k, tokens shared): the deepest checkpoint of the kept line whose tokens
    all equal the render's, and how far into the next turn's prompt they still do.

    A template that rewrites history on every step (Qwen3 with thinking off drops the
    last assistant message's prefilled empty think block once a tool result follows)
    would otherwise make every fork a full copy of the context: memory quadratic in the
    turns. Sharing stops at the first differing token and before the next turn's first
    sampled token (sampled on the parent, mask 1; on the new branch it is prompt, mask 0,
    so it cannot be a shared segment). The new branch still equals the render token for
    token: the shared tokens are equal ones."""
    done = prep.context_ids
    n = min(len(done), len(full))
    differ = np.flatnonzero(done[:n] != np.asarray(full[:n], dtype=np.int64))
    same = int(differ[0]) if len(differ) else n
    cps = prep.line_checkpoints
    k = bisect_right(cps, same) - 1
    limit = prep.line_output_starts[k] if k < len(prep.line_output_starts) else cps[k]
    return k, min(same, limit)


RENDER_INLINE_CHARS = 4 * 1024
"""Renders of less than this (messages and tools, as JSON) run on the loop: rendering
costs about 0.7 µs per character here, twenty times parsing's, so its threshold is
lower than `offload.INLINE_BYTES` (a 16 KB render held the loop ~11 ms)."""


def _inline_size(chars: int) -> int:
    """A render's size on `run_sized`'s scale: under it exactly when under `RENDER_INLINE_CHARS`."""
    return 0 if chars < RENDER_INLINE_CHARS else INLINE_BYTES


def _render_size(messages: Sequence[Message], tools: Any) -> int:
    """About the characters a render of `messages` with `tools` reads: every field's text
    (templates render reasoning under any of its names, and more), counted only up to
    `RENDER_INLINE_CHARS` so that measuring a large request costs no more than a small one."""
    return _bounded_size([messages, tools], RENDER_INLINE_CHARS)


def _bounded_size(value: Any, budget: int) -> int:
    """Characters of `value`'s strings (8 per other leaf, keys included), stopping once
    `budget` is reached."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        items: Any = (x for kv in value.items() for x in kv)
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return 8
    size = 0
    for item in items:
        size += _bounded_size(item, budget - size)
        if size >= budget:
            break
    return size


def _no_note(kind: str, **fields: Any) -> None:
    """`Session.note` for a render that is not a turn."""


def _history_rewrite(prep: Prepared, offset: int | None) -> dict[str, Any]:
    """The per-turn TITO diagnostic: which committed turn a full re-render would
    change and its first differing token (absolute position; None when the change is in
    the turn's closing tokens or could not be located)."""
    if prep.prev_output is None:
        return {"rewritten_turn": None, "first_diff": None}
    index, start, end = prep.prev_output
    first = None if offset is None else min(start + offset, end)
    return {"rewritten_turn": index, "first_diff": first}


def check_branch_cap(ctx: ServerContext, session: Session, prep: Prepared) -> None:
    """A rollback or fork adds a branch (sharing its prefix, but O(turns) of records): refuse past the cap
    (before generating, so the refused turn costs the engine nothing)."""
    cap = ctx.settings.max_branches
    if prep.kind in ("rollback", "fork") and len(session.tree) >= cap:
        raise BranchLimit(
            f"session {session.id} has {len(session.tree)} branches, the cap (max_branches={cap}); "
            "a retry or fork needs a new branch: start a new session"
        )
