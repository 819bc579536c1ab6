"""One line of a session as the viewer's token view reads it: `GET /sessions/{sid}/line`.

`/trajectory` sends each branch's own part only (a fork's tokens start at its
`fork_index`, its turns at its fork checkpoint: O(unique tokens) for trainers), while
the token view indexes the mask, logprobs, turns and the `/tokens` texts by the line's
absolute positions. Stitching a branch onto its ancestors in the page would repeat
the tree's own logic (`trajectory.linear`'s shared segments) in JavaScript; the server
has the line already, so it sends it whole: the parent chain's prefix up to each fork
point followed by the branch's own tokens and turns (every turn of the line, absolute
positions). The arrays are copied under the session lock in an offload thread (a
commit must not change them mid-copy; a 100K-token line is one C-level gather, and a
one-segment line, whose gather is a view of the live buffer, one more C-level copy:
the body is serialised after the lock is released, when an undone commit and the next
may have rewritten those positions).

It also says which tokens are tool output (`tool_spans`, `trajectory.tool_spans`: the
codec's render, not text matching), computed after the lock is released, off the loop,
and kept per committed turn (a turn never changes): a 100-turn line is rendered once. A
turn no render reproduces is kept as unknown; one whose render raised is not kept (a
transient failure is tried again by the next read).
"""

from __future__ import annotations

import threading
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from trajectory.export import turn_to_dict
from trajectory.tool_spans import line_tool_spans
from trajectory.turn_record import TurnRecord

from ..errors import BadRequest
from ..sessions import Session
from .edge import route_doc
from .routes.common import JSON, ctx_of

__all__ = ["router"]

router = APIRouter()

# turns whose tool spans are kept (by session and turn seq); cleared when full. A deleted
# session's entries stay until then (bounded; the store has no delete hook for the api)
SPANS_KEPT = 16_384
_spans: dict[tuple[str, int], list[tuple[int, int]] | None] = {}
_spans_lock = threading.Lock()  # offload threads of several viewers write it


def _snapshot(s: Session, branch: int) -> dict[str, Any]:
    """What the line is now: arrays (copied here, never views of the live buffer),
    turns, messages and counts (immutable records): read under the session lock, in an
    offload thread."""
    b = s.tree.get(branch)
    traj = b.trajectory
    # copies: a one-segment line's gather is a view of the live buffer, which an undone
    # commit and the next rewrite in place once the lock is released, while `_body` runs
    ids, lps, mask = (np.array(x, copy=True) for x in traj.arrays())
    return {"branch": b, "ids": ids, "logprobs": lps, "mask": mask, "turns": traj.turns,
            "messages": traj.messages(), "counts": traj.checkpoint_message_counts,
            "tools": s.tools_by_branch.get(branch), "kwargs": dict(s.config.chat_template_kwargs)}


def _body(sid: str, codec: Any, snap: dict[str, Any]) -> bytes:
    """The line's JSON with its tool spans (renders for turns not seen before); the
    arrays go to orjson as numpy (no Python list of 100K ints)."""
    turns: tuple[TurnRecord, ...] = snap["turns"]
    with _spans_lock:
        known = {t.seq: _spans[(sid, t.seq)] for t in turns if (sid, t.seq) in _spans}
    found = line_tool_spans(codec, snap["ids"], turns, snap["messages"], snap["counts"], tools=snap["tools"],
                            template_kwargs=snap["kwargs"], known=known)
    with _spans_lock:
        if len(_spans) + len(found) > SPANS_KEPT:
            _spans.clear()
        _spans.update({(sid, seq): v for seq, v in found.items() if seq not in known})
    b = snap["branch"]
    return orjson.dumps({
        "id": b.id, "parent_id": b.parent_id, "fork_checkpoint": b.fork_checkpoint, "fork_index": b.fork_index,
        "reason": b.reason,
        "token_ids": snap["ids"], "loss_mask": snap["mask"], "logprobs": snap["logprobs"],
        "turns": [turn_to_dict(t) for t in turns],
        "tool_spans": [list(span) for t in turns for span in (found.get(t.seq) or [])],
        "tool_spans_unknown": [i for i, t in enumerate(turns) if found.get(t.seq) is None],
    }, option=orjson.OPT_SERIALIZE_NUMPY)


@router.get("/sessions/{sid}/line", **route_doc(None, 400, 404))
async def line(sid: str, request: Request, branch: Annotated[int, Query(ge=0)]) -> Response:
    """One branch's whole line: `token_ids`, `loss_mask`, `logprobs` from position 0,
    every turn of the line (absolute positions), the branch's own facts (`id`,
    `parent_id`, `fork_checkpoint`, `fork_index`, `reason`), and `tool_spans`: the
    `[start, end)` token ranges holding tool messages' content; `tool_spans_unknown`:
    the turns (line indexes) whose prompt no render of the codec reproduces, so their
    tool output is not marked."""
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    async with s.lock:  # a commit must not change the branch while the thread copies it
        # checked here, not before the lock: a fork commit that failed may have discarded
        # the branch meanwhile (`tree.discard`)
        if branch not in {b.id for b in s.tree.branches()}:
            raise BadRequest(f"session {sid} has no branch {branch}")
        snap = await ctx.offload.run(_snapshot, s, branch)
    return Response(content=await ctx.offload.run(_body, sid, ctx.codec, snap), media_type=JSON)
