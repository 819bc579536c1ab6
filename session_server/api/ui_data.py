"""The trajectory viewer's own data: what the existing JSON routes do not already say.

The viewer's pages (`ui.py`) read a session through the routes every client has
(`GET /sessions/{sid}`, `/trajectory`, `/samples`, `/control/state`, `/engines`); this
module adds three thin ones:

- `GET /ui/api/sessions`: the sessions, filtered and paged. The store is copied on
  the loop (one C-level list copy) and filtered in the offload threads, so 10,000
  sessions cost the loop nothing per session; a page costs O(sessions) to filter and
  sort and O(page) rows, never a session's history. In a cluster (`--peers`) the
  instance asked merges its peers' first `offset + limit` matched rows with its own
  (the same fan-out a peer sync reads with, control/relay.py), so the list covers every
  instance whichever one the proxy picked; a peer that does not answer is named in
  `missing`. Newest first is by each instance's monotonic clock: one machine's
  instances (`session-server cluster`) share it.
- `GET /sessions/{sid}/tokens?branch=&start=&end=`: the text of each token of a range
  of a line, decoded one id at a time (a token's own text, not the text of the run it
  sits in; a character split over tokens goes to the token completing it), off the loop. The page asks for the chunks it shows, so a 100K-token line is
  never decoded or sent whole.
- `GET /sessions/{sid}/live`: server-sent events of the session's turns as they run
  (`turn/watch.py`). Under `/sessions/{sid}/` so a cluster's proxy routes it to the
  session's instance by its id, as every other session route.

All of them need the admin token when auth is on (`auth.py`: neither is an agent route).
"""

from __future__ import annotations

import asyncio
import hmac
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any
from urllib.parse import urlencode

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from trajectory.samples import DEFAULT_PICKER, PICKERS

from ..control.relay import RELAYED_HEADER
from ..errors import BadRequest, TooManyViewers
from ..sessions import Session, instance_of
from ..turn.watch import LiveTurn
from ..turn.watch import token_texts as live_texts
from .edge import route_doc
from .routes.common import ctx_of, json_response, relay_of
from .routes.sessions import turns_total

__all__ = ["router"]

router = APIRouter()

MAX_PAGE = 500  # sessions a client's page holds
MAX_OFFSET = 100_000  # how deep a page may start: a peer's part is at most this plus a page of rows
PEER_LIST_S = 10.0  # a peer slower than this to list is named in `missing`: the page shows the rest
MAX_TOKEN_RANGE = 4096  # tokens per `/tokens` read: one chunk of the page, decoded in one offload hop
MAX_VIEWERS_PER_SESSION = 8  # live streams of one session: a page left open in many tabs is bounded
MAX_VIEWERS = 256  # live streams of this process: each holds a connection and a small queue
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


def _order(s: Session) -> tuple[float, str]:
    return s.created_at, s.id


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
    kept.sort(key=_order, reverse=True)  # the id breaks ties (replayed sessions share one time): pages never overlap
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


def _from_peer(request: Request, admin_token: str | None) -> bool:
    """A peer's part of a cluster page (`x-tito-relayed`), which reaches down to the
    page's end: believed only with the admin bearer token (a relay sends it, control/
    relay.py), never with the viewer cookie or nothing. Without auth nobody holds more
    than anybody else, and MAX_OFFSET still bounds the rows."""
    if request.headers.get(RELAYED_HEADER) is None:
        return False
    if admin_token is None:
        return True
    return hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {admin_token}".encode())


def _malformed(part: Any) -> str | None:
    """Why a peer's list reply cannot be merged (a peer of another version, a proxy's
    page), or None: such a peer is `missing`, never a 500 for the whole list."""
    if not isinstance(part, dict):
        return "malformed reply: not an object"
    for key, kind in (("total", int), ("matched", int), ("sessions", list), ("homes", dict), ("instances", list)):
        if not isinstance(part.get(key), kind):
            return f"malformed reply: {key!r} missing or not a {kind.__name__}"
    for row in part["sessions"]:
        if not (isinstance(row, dict) and isinstance(row.get("session_id"), str)
                and isinstance(row.get("created_at"), int | float)):
            return "malformed reply: a session row without session_id or created_at"
    if not all(isinstance(n, int) for n in part["homes"].values()):
        return "malformed reply: 'homes' counts are not integers"
    return None


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
    limit: Annotated[int, Query(ge=1)] = 50,
) -> Response:
    """The cluster's sessions (this instance's, and with `--peers` every peer's), newest
    first, filtered and paged; `homes`: how many sessions each engine target is home to
    (all sessions, not only the matched); `instances`: who answered, `missing`: the
    peers that did not (their sessions are not in the list)."""
    ctx = ctx_of(request)
    relay = relay_of(request)
    if offset > MAX_OFFSET:
        raise BadRequest(f"offset: at most {MAX_OFFSET} (asked {offset}); narrow the filters instead")
    if limit > MAX_PAGE and not (limit <= MAX_OFFSET + MAX_PAGE and _from_peer(request, ctx.settings.admin_token)):
        raise BadRequest(f"limit: at most {MAX_PAGE} sessions a page (asked {limit})")
    q = {"state": state, "instance": instance, "busy": busy, "has_diagnostics": has_diagnostics,
         "reward_min": reward_min, "reward_max": reward_max, "meta": _meta_filters(meta or []),
         "offset": offset, "limit": limit}
    sessions = list(ctx.store.all().values())
    if not relay.wanted(request.headers):
        out = await ctx.offload.run(_listing, sessions, q)
        return json_response({**out, "instances": [ctx.store.instance_id], "missing": {}})
    # every instance's first offset+limit matched rows, merged: the page is the same
    # whichever instance the proxy picked
    params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("offset", "limit")]
    path = "/ui/api/sessions?" + urlencode([*params, ("offset", 0), ("limit", offset + limit)])
    misses: dict[str, str] = {}
    local, peers = await asyncio.gather(
        ctx.offload.run(_listing, sessions, {**q, "offset": 0, "limit": offset + limit}),
        relay.fetch(path, timeout_s=min(PEER_LIST_S, ctx.settings.peer_timeout_s), misses=misses))
    for peer, p in peers.items():
        if p is not None and (why := _malformed(p)) is not None:
            misses[peer], peers[peer] = why, None
    parts = [local, *(p for p in peers.values() if isinstance(p, dict))]
    rows = sorted((r for p in parts for r in p["sessions"]), key=lambda r: (r["created_at"], r["session_id"]),
                  reverse=True)
    homes: dict[str, int] = {}
    for p in parts:
        for home, n in p["homes"].items():
            homes[home] = homes.get(home, 0) + n
    answered = [ctx.store.instance_id] + [i for p in parts[1:] for i in p.get("instances", [])]
    return json_response({
        "total": sum(p["total"] for p in parts), "matched": sum(p["matched"] for p in parts),
        "offset": offset, "limit": limit, "sessions": rows[offset:offset + limit], "homes": homes,
        "instances": answered, "missing": {peer: misses.get(peer, "no answer") for peer, p in peers.items()
                                           if not isinstance(p, dict)}})


@router.get("/ui/api/meta", **route_doc(None))
async def meta(request: Request) -> Response:
    """What the pages offer as choices: the samples' pickers, this instance's id."""
    ctx = ctx_of(request)
    return json_response({"pickers": sorted(PICKERS), "default_picker": DEFAULT_PICKER,
                          "instance_id": ctx.store.instance_id})


UTF8_LOOKAROUND = 4  # tokens read either side of a range: a character it cuts is still whole
MAX_CHAR_TOKENS = 8  # a run of partial tokens longer than this is not one character: shown as is


def _texts(tokenizer: Any, ids: list[int], skip: int) -> tuple[list[str], list[tuple[int, int]]]:
    """Each token's text, with a UTF-8 character whose bytes several tokens hold (a
    byte-level BPE splits an emoji or a CJK character) on the token that completes it:
    alone, each of those tokens decodes to U+FFFD. The others get "" and a
    `(token, completing token)` pair in the second list. `ids` starts `skip` tokens
    before the range (and the caller reads past its end), so a character the range
    cuts is whole; the result covers `ids[skip:]`, positions relative to it."""
    def one(i: int) -> str:
        return str(tokenizer.decode([i], skip_special_tokens=False))

    texts: list[str] = []
    parts: list[tuple[int, int]] = []
    run: list[int] = []  # positions of the partial tokens not yet completed

    def flush() -> None:  # never completed (a real U+FFFD, a cut line): each token's own text
        for k in run:
            texts[k] = one(ids[k])
        run.clear()

    for k, i in enumerate(ids):
        texts.append("")
        alone = one(i)
        if "\ufffd" not in alone:
            if not run:
                texts[k] = alone
                continue
            joined = str(tokenizer.decode(ids[run[0]:k + 1], skip_special_tokens=False))
            if joined == str(tokenizer.decode(ids[run[0]:k], skip_special_tokens=False)) + alone:
                flush()  # this token completes nothing: the run before it stays as it was
                texts[k] = alone
                continue
            run.append(k)
        else:
            run.append(k)
            joined = str(tokenizer.decode(ids[run[0]:k + 1], skip_special_tokens=False))
        if not joined.endswith("\ufffd"):  # the run ends in a whole character: this token completes it
            while joined.startswith("\ufffd") and len(run) > 1:  # bytes of a character begun before `ids`
                orphan = run.pop(0)
                texts[orphan] = one(ids[orphan])
                joined = str(tokenizer.decode(ids[run[0]:k + 1], skip_special_tokens=False))
            texts[k] = joined
            parts += [(p, k) for p in run[:-1]]
            run.clear()
        elif len(run) >= MAX_CHAR_TOKENS:
            flush()
    flush()
    return texts[skip:], [(p - skip, k - skip) for p, k in parts if p >= skip]


@router.get("/sessions/{sid}/tokens", **route_doc(None, 400, 404))
async def token_texts(
    sid: str, request: Request, branch: Annotated[int, Query(ge=0)],
    start: Annotated[int, Query(ge=0)] = 0, end: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """`{"branch", "start", "end", "texts", "parts"}`: each token's own text in [start, end)
    of the branch's line (at most MAX_TOKEN_RANGE tokens; `end` defaults to that bound);
    a character split over tokens is the text of the token that completes it, and each
    `[token, completing token]` of `parts` (line positions) names one holding only bytes."""
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    if branch not in {b.id for b in s.tree.branches()}:
        raise BadRequest(f"session {sid} has no branch {branch}")
    line = s.tree.get(branch).trajectory
    stop = min(len(line), start + MAX_TOKEN_RANGE if end is None else end)
    if stop - start > MAX_TOKEN_RANGE:
        raise BadRequest(f"at most {MAX_TOKEN_RANGE} tokens per read (asked {stop - start})")
    # a few tokens either side: a character cut by the range's start or end is still whole
    first, last = max(0, start - UTF8_LOOKAROUND), min(len(line), stop + UTF8_LOOKAROUND)
    ids = line.ids_range(first, last).tolist() if stop > start else []  # O(range), not O(last)
    texts, parts = await ctx.offload.run(_texts, ctx.tokenizer, ids, start - first) if ids else ([], [])
    return json_response({"branch": branch, "start": start, "end": max(start, stop), "texts": texts[:stop - start],
                          "parts": [[start + p, start + k] for p, k in parts if p < stop - start]})


def _frame(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


class _Viewer:
    """One viewer's events: a bounded deque and an Event its stream waits on (a put
    is an append and a set, on the loop; no task per event or per wait)."""

    def __init__(self) -> None:
        self.events: deque[dict[str, Any]] = deque()
        self.ready = asyncio.Event()
        self.lost = False  # fell more than LIVE_QUEUE events behind: the page reads the tree again

    def __call__(self, event: dict[str, Any]) -> None:
        if len(self.events) >= LIVE_QUEUE:
            self.lost = True
        else:
            self.events.append(event)
        self.ready.set()


def _viewer_count(app: Any) -> list[int]:
    """This process's open live streams (a one-element list: mutable on app.state)."""
    count: list[int] | None = getattr(app.state, "live_viewers", None)
    if count is None:
        count = app.state.live_viewers = [0]
    return count


def _hello(s: Session) -> dict[str, Any]:
    """What a viewer opening now needs: the turns committed so far (`turns_total`, as in
    the session view: a page that reconnected reads again when it drew fewer or more),
    whether a turn is in flight, and when known its
    branch, output start and tokens so far (copied here, on the loop: C-level list
    copies; their texts are decoded in an offload thread)."""
    out: dict[str, Any] = {"event": "hello", "busy": s.inflight is not None, "active_branch": s.tree.active_id,
                           "turns_total": turns_total(s)}
    if isinstance(s.live_turn, LiveTurn):
        out["turn"] = s.live_turn.view()
    return out


@router.get("/sessions/{sid}/live", **route_doc(None, 404, 429, media=("text/event-stream",)))
async def live(sid: str, request: Request) -> Response:
    """Server-sent events of the session's turns: `hello` (whether a turn is in flight
    and, when one is, `turn`: its branch, output start and tokens so far, `known` False
    when some were not seen), then `begin`, `tokens` (ids, logprobs and texts as
    sampled), `restart`, `unshown`, `end`; `resync` when this viewer fell more than
    LIVE_QUEUE events behind (its page reads the tree again). At most
    MAX_VIEWERS_PER_SESSION streams a session and MAX_VIEWERS a process (else 429
    too_many_viewers). The stream ends when the client goes (Starlette cancels it on
    the disconnect), when the session is gone, or after MAX_LIVE_S."""
    ctx = ctx_of(request)
    s = ctx.store.get(sid)
    count = _viewer_count(request.app)
    if len(s.watchers) >= MAX_VIEWERS_PER_SESSION:
        raise TooManyViewers(f"session {sid} already has {MAX_VIEWERS_PER_SESSION} live viewers")
    if count[0] >= MAX_VIEWERS:
        raise TooManyViewers(f"this instance already serves {MAX_VIEWERS} live viewers")
    viewer = _Viewer()
    s.watchers.append(viewer)  # counted now, not when the body starts: a burst cannot pass the caps
    count[0] += 1

    async def frames() -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MAX_LIVE_S
        try:
            hello = _hello(s)
            viewer.events.clear()  # what came before now is in `hello`: sent once, not twice
            viewer.lost = False
            if "turn" in hello:
                hello["turn"]["texts"] = await ctx.offload.run(live_texts, ctx.tokenizer, hello["turn"]["ids"])
            yield _frame(hello)
            while loop.time() < deadline:
                if not viewer.events and not viewer.lost:
                    viewer.ready.clear()
                    try:
                        async with asyncio.timeout(KEEPALIVE_S):
                            await viewer.ready.wait()
                    except TimeoutError:
                        if ctx.store.all().get(s.id) is not s:
                            yield _frame({"event": "gone"})
                            return
                        yield b": keep-alive\n\n"
                        continue
                if viewer.lost:
                    viewer.events.clear()
                    viewer.lost = False
                    yield _frame({"event": "resync"})
                    continue
                yield _frame(viewer.events.popleft())
        finally:
            release()

    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            count[0] -= 1
            if viewer in s.watchers:
                s.watchers.remove(viewer)

    return _LiveResponse(release, frames(), media_type="text/event-stream",
                         headers={"cache-control": "no-store", "x-accel-buffering": "no"})


class _LiveResponse(StreamingResponse):
    """A live stream that gives its viewer's place back however the response ends: a
    body generator that never started (the client left first) runs no `finally`."""

    def __init__(self, release: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
