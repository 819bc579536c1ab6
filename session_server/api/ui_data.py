"""The trajectory viewer's own data: what the existing JSON routes do not already say.

The viewer's pages (`ui.py`) read a session through the routes every client has
(`GET /sessions/{sid}`, `/trajectory`, `/samples`, `/control/state`, `/engines`); this
module adds three thin ones:

- `GET /ui/api/sessions`: this instance's sessions, filtered and paged. The store is
  copied on the loop (one C-level list copy) and filtered in the offload threads, so
  10,000 sessions cost the loop nothing per session.
- `GET /sessions/{sid}/tokens?branch=&start=&end=`: the text of each token of a range
  of a line, decoded one id at a time (a token's own text, not the text of the run it
  sits in), off the loop. The page asks for the chunks it shows, so a 100K-token line is
  never decoded or sent whole.
- `GET /sessions/{sid}/live`: server-sent events of the session's turns as they run
  (`turn/watch.py`). Under `/sessions/{sid}/` so a cluster's proxy routes it to the
  session's instance by its id, as every other session route.

All of them need the admin token when auth is on (`auth.py`: neither is an agent route).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from trajectory.samples import DEFAULT_PICKER, PICKERS

from ..errors import BadRequest
from ..sessions import Session, instance_of
from .edge import route_doc
from .routes.common import ctx_of, json_response

__all__ = ["router"]

router = APIRouter()

MAX_TOKEN_RANGE = 4096  # tokens per `/tokens` read: one chunk of the page, decoded in one offload hop
LIVE_QUEUE = 2048  # events a slow viewer may fall behind by before it is told to read the tree again
KEEPALIVE_S = 15.0  # a comment frame this often: proxies keep the stream open, a gone session ends it
MAX_LIVE_S = 600.0  # a stream ends after this (EventSource reconnects): none outlives a stuck client


def _row(s: Session) -> dict[str, Any]:
    """One session's list row: O(branches), no tokens."""
    traj = s.tree.active.trajectory
    return {
        "session_id": s.id,
        "instance": instance_of(s.id),
        "state": s.state.value,
        "busy": s.inflight is not None,
        "home": s.home,
        "metadata": s.config.metadata,
        "reward": s.reward,
        "turns": len(traj.turns),
        "tokens": len(traj),
        "branches": len(s.tree),
        "diagnostics": len(s.diagnostics) + s.diagnostics_dropped,
        "created_at": s.created_at,
    }


def _meta_match(metadata: dict[str, Any], wanted: Sequence[tuple[str, str | None]]) -> bool:
    for key, value in wanted:
        if key not in metadata:
            return False
        if value is not None:
            got = metadata[key]
            if (got if isinstance(got, str) else orjson.dumps(got).decode()) != value:
                return False
    return True


def _listing(sessions: list[Session], q: dict[str, Any]) -> dict[str, Any]:
    """Filter, sort (newest first) and page `sessions`: runs in an offload thread."""
    homes: dict[str, int] = {}
    kept: list[Session] = []
    for s in sessions:
        home = s.home or "(none)"
        homes[home] = homes.get(home, 0) + 1
        if q["state"] is not None and s.state.value != q["state"]:
            continue
        if q["instance"] is not None and instance_of(s.id) != q["instance"]:
            continue
        if q["busy"] is not None and (s.inflight is not None) != q["busy"]:
            continue
        if q["has_diagnostics"] is not None and bool(s.diagnostics or s.diagnostics_dropped) != q["has_diagnostics"]:
            continue
        if q["reward_min"] is not None and (s.reward is None or s.reward < q["reward_min"]):
            continue
        if q["reward_max"] is not None and (s.reward is None or s.reward > q["reward_max"]):
            continue
        if q["meta"] and not _meta_match(s.config.metadata, q["meta"]):
            continue
        kept.append(s)
    kept.sort(key=lambda s: s.created_at, reverse=True)
    page = kept[q["offset"]: q["offset"] + q["limit"]]
    return {"total": len(sessions), "matched": len(kept), "offset": q["offset"], "limit": q["limit"],
            "sessions": [_row(s) for s in page], "homes": homes}


def _meta_filters(meta: list[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for item in meta:
        key, eq, value = item.partition("=")
        if not key:
            raise BadRequest(f"meta filter {item[:64]!r}: expected 'key' or 'key=value'")
        out.append((key, value if eq else None))
    return out


@router.get("/ui/api/sessions", **route_doc(None, 400))
async def list_sessions(
    request: Request,
    state: str | None = None,
    instance: str | None = None,
    busy: bool | None = None,
    has_diagnostics: bool | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    meta: Annotated[list[str] | None, Query(max_length=16)] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> Response:
    """This instance's sessions, newest first, filtered and paged; `homes`: how many
    sessions each engine target is home to (all sessions, not only the matched)."""
    ctx = ctx_of(request)
    q = {"state": state, "instance": instance, "busy": busy, "has_diagnostics": has_diagnostics,
         "reward_min": reward_min, "reward_max": reward_max, "meta": _meta_filters(meta or []),
         "offset": offset, "limit": limit}
    sessions = list(ctx.store.all().values())
    return json_response(await ctx.offload.run(_listing, sessions, q))


@router.get("/ui/api/meta", **route_doc(None))
async def meta(request: Request) -> Response:
    """What the pages offer as choices: the samples' pickers, this instance's id."""
    ctx = ctx_of(request)
    return json_response({"pickers": sorted(PICKERS), "default_picker": DEFAULT_PICKER,
                          "instance_id": ctx.store.instance_id})


def _texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


@router.get("/sessions/{sid}/tokens", **route_doc(None, 400, 404))
async def token_texts(
    sid: str, request: Request, branch: Annotated[int, Query(ge=0)],
    start: Annotated[int, Query(ge=0)] = 0, end: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """`{"branch", "start", "end", "texts"}`: each token's own text in [start, end) of the
    branch's line (at most MAX_TOKEN_RANGE tokens; `end` defaults to that bound)."""
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    if branch not in {b.id for b in s.tree.branches()}:
        raise BadRequest(f"session {sid} has no branch {branch}")
    line = s.tree.get(branch).trajectory
    stop = min(len(line), start + MAX_TOKEN_RANGE if end is None else end)
    if stop - start > MAX_TOKEN_RANGE:
        raise BadRequest(f"at most {MAX_TOKEN_RANGE} tokens per read (asked {stop - start})")
    ids = line.ids_until(stop)[start:stop].tolist() if stop > start else []
    texts = await ctx.offload.run(_texts, ctx.tokenizer, ids)
    return json_response({"branch": branch, "start": start, "end": max(start, stop), "texts": texts})


def _frame(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


@router.get("/sessions/{sid}/live", **route_doc(None, 404, media=("text/event-stream",)))
async def live(sid: str, request: Request) -> Response:
    """Server-sent events of the session's turns: `hello` (whether a turn is in flight),
    then `begin`, `tokens` (a streamed turn's deltas), `end`; `resync` when this viewer
    fell more than LIVE_QUEUE events behind (its page reads the tree again). The
    stream ends when the client goes (Starlette cancels it on the disconnect), when the
    session is gone, or after MAX_LIVE_S."""
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=LIVE_QUEUE)
    lost = False

    def subscriber(event: dict[str, Any]) -> None:
        nonlocal lost
        try:
            queue.put_nowait(event)
        except asyncio.QueueFull:
            lost = True

    async def frames() -> AsyncIterator[bytes]:
        nonlocal lost
        s.watchers.append(subscriber)
        deadline = asyncio.get_running_loop().time() + MAX_LIVE_S
        try:
            yield _frame({"event": "hello", "busy": s.inflight is not None, "active_branch": s.tree.active_id})
            while asyncio.get_running_loop().time() < deadline:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)
                except TimeoutError:
                    if ctx.store.all().get(s.id) is not s:
                        yield _frame({"event": "gone"})
                        return
                    yield b": keep-alive\n\n"
                    continue
                if lost:
                    while not queue.empty():
                        queue.get_nowait()
                    lost = False
                    yield _frame({"event": "resync"})
                    continue
                if event["event"] == "tokens":  # a delta is a few ids: decoded here, on the loop
                    event = {**event, "texts": [ctx.tokenizer.decode([i], skip_special_tokens=False)
                                                for i in event["ids"]]}
                yield _frame(event)
        finally:
            if subscriber in s.watchers:
                s.watchers.remove(subscriber)

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"cache-control": "no-store", "x-accel-buffering": "no"})
