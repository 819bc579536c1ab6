"""The viewer's data routes: the session list pages every session exactly once under
its filters, and the token texts show a character split over tokens on the token that
completes it (the offline qwen3 tokenizer is byte-level: an emoji is four tokens)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from transformers import AutoTokenizer

from session_server.api.ui_line import _body, _snapshot
from session_server.auth import ui_cookie_value
from session_server.context import Settings
from session_server.ops.harness import live_apps

from ..stack import live_stack

SPLIT = "naïve 😀 世界 ok"


async def test_session_list_pages_hold_every_matching_session_exactly_once(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sem = asyncio.Semaphore(16)

        async def make(k: int) -> str:
            async with sem:
                return await st.session(metadata={"task": f"t{k % 3}", "k": k})

        sids = await asyncio.gather(*(make(k) for k in range(300)))
        want = {sid for k, sid in enumerate(sids) if k % 3 == 1}
        for params, expected in (({}, set(sids)), ({"meta": "task=t1"}, want)):
            seen: list[str] = []
            times: list[float] = []
            offset = 0
            while True:
                r = await st.http.get("/ui/api/sessions", params={**params, "offset": offset, "limit": 37})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["total"] == 300 and body["matched"] == len(expected)
                if not body["sessions"]:
                    break
                seen += [row["session_id"] for row in body["sessions"]]
                times += [row["created_at"] for row in body["sessions"]]
                offset += 37
            assert len(seen) == len(set(seen)) == len(expected)  # nothing twice, nothing skipped
            assert set(seen) == expected
            assert times == sorted(times, reverse=True)  # newest first, across pages
        assert (await st.http.get("/ui/api/sessions", params={"limit": 501})).status_code == 400


async def test_a_character_split_over_tokens_shows_on_the_token_that_completes_it(qwen3_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    assert "\ufffd" in tok.decode(tok.encode("😀", add_special_tokens=False)[:1])  # the split the test is about
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": [{"role": "user", "content": SPLIT}], "max_tokens": 8})
        assert r.status_code == 200, r.text
        ids = (await st.trajectory(sid))["branches"][0]["token_ids"]
        body = (await st.http.get(f"/sessions/{sid}/tokens", params={"branch": 0})).json()
        texts = body["texts"]
        assert "".join(texts) == tok.decode(ids, skip_special_tokens=False)  # the line's text, whole
        assert not any("\ufffd" in t for t in texts)
        assert "😀" in texts and "世" in texts and "界" in texts
        at = texts.index("😀")
        assert [p for p, k in body["parts"] if k == at] == [at - 3, at - 2, at - 1]  # the emoji's 4 byte tokens
        assert all(texts[p] == "" for p, _ in body["parts"])
        # a range that starts inside the emoji still shows it whole on its last token
        part = (await st.http.get(f"/sessions/{sid}/tokens", params={"branch": 0, "start": at - 1, "end": at + 3})).json()
        assert part["texts"][:2] == ["", "😀"] and [p for p in part["parts"] if p[1] == at] == [[at - 1, at]]
        # and one that ends inside it: its bytes point at the token past the end that completes it
        part = (await st.http.get(f"/sessions/{sid}/tokens", params={"branch": 0, "start": at - 5, "end": at - 1})).json()
        assert len(part["texts"]) == 4 and "\ufffd" not in "".join(part["texts"])
        assert [[at - 3, at], [at - 2, at]] == [p for p in part["parts"] if p[1] == at]
        # cut anywhere, the ranges' texts still make the line's text, with no U+FFFD
        for size in (1, 2, 3, 5):
            texts = []
            for a in range(0, len(ids), size):
                texts += (await st.http.get(f"/sessions/{sid}/tokens",
                                            params={"branch": 0, "start": a, "end": a + size})).json()["texts"]
            assert "".join(texts) == tok.decode(ids, skip_special_tokens=False), size


@contextlib.asynccontextmanager
async def _peer_answering(body: bytes) -> AsyncIterator[str]:
    """A stand-in peer: every GET answers 200 with `body` (another version's reply, a
    proxy's page)."""
    async def any_get(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", any_get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


ADMIN = "admin-secret-token"


async def test_a_malformed_peer_list_reply_names_that_peer_missing(qwen3_dir: Path) -> None:
    bad = (b'{"total": 1, "matched": 1, "sessions": [{"state": "idle"}], "homes": {}, "instances": ["x"]}', b'{}',
           b'[1, 2]', b'{"total": 1, "matched": 1, "sessions": [], "homes": {"a": "1"}, "instances": []}')
    for body in bad:
        async with _peer_answering(body) as peer, \
                live_stack(qwen3_dir, settings=Settings(peers=[peer], peer_timeout_s=2.0)) as st:
            sid = await st.session()
            r = await st.http.get("/ui/api/sessions")
            assert r.status_code == 200, (body, r.text)
            out = r.json()
            assert [row["session_id"] for row in out["sessions"]] == [sid]
            assert out["missing"][peer].startswith("malformed reply"), out["missing"]


async def test_only_the_admin_token_lifts_the_page_limit_of_a_relayed_list(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(admin_token=ADMIN)) as st:
        relayed = {"x-tito-relayed": "1"}
        admin = {"authorization": f"Bearer {ADMIN}"}
        assert (await st.http.get("/ui/api/sessions", params={"limit": 5000}, headers=admin)).status_code == 400
        assert (await st.http.get("/ui/api/sessions", params={"limit": 5000},
                                  headers={**relayed, **admin})).status_code == 200
        st.http.cookies.set("tito_ui", ui_cookie_value(ADMIN))
        r = await st.http.get("/ui/api/sessions", params={"limit": 5000}, headers=relayed)
        assert r.status_code == 400, r.text  # the viewer cookie is read-only, not a peer
        r = await st.http.get("/ui/api/sessions", params={"limit": 10**9}, headers={**relayed, **admin})
        assert r.status_code == 400, r.text  # a peer's part is bounded too
        r = await st.http.get("/ui/api/sessions", params={"offset": 10**9}, headers=admin)
        assert r.status_code == 400, r.text


TOOLS = [{"type": "function", "function": {"name": "search", "description": "search the repo",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
TOOL_SCRIPT = [{"content": "Searching.", "tool_calls": [{"name": "search", "arguments": {"q": "config"}},
                                                        {"name": "search", "arguments": {"q": "tests"}}]},
               {"content": "Found it."}]
TOOL_OUTPUTS = ("42 files found in /src/config", "no match: the tests dir is empty")


async def tool_session(st: Any) -> str:
    """Two turns: the model calls `search` twice, the agent answers both calls (two tool
    messages in turn 1's prompt), the model answers."""
    sid = await st.session()
    first = [{"role": "user", "content": "Where is the config?"}]
    r = await st.chat(sid, {"messages": first, "tools": TOOLS, "max_tokens": 200})
    assert r.status_code == 200, r.text
    a = r.json()["choices"][0]["message"]
    assert len(a["tool_calls"]) == 2, a  # the scene is what the test claims
    results = [{"role": "tool", "tool_call_id": c["id"], "content": out}
               for c, out in zip(a["tool_calls"], TOOL_OUTPUTS, strict=True)]
    r = await st.chat(sid, {"messages": [*first, a, *results], "tools": TOOLS, "max_tokens": 50})
    assert r.status_code == 200, r.text
    return sid


def _exact_ranges(tok: Any, ids: list[int], lo: int, hi: int, text: str) -> list[tuple[int, int]]:
    """Every [a, b) within [lo, hi) whose tokens decode to exactly `text`."""
    return [(a, b) for a in range(lo, hi) for b in range(a + 1, hi + 1)
            if tok.decode(ids[a:b], skip_special_tokens=False) == text]


async def test_the_line_marks_exactly_each_tool_messages_content_tokens_as_tool_output(qwen3_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    async with live_stack(qwen3_dir, script=TOOL_SCRIPT) as st:
        sid = await tool_session(st)
        r = await st.http.get(f"/sessions/{sid}/line", params={"branch": 0})
        assert r.status_code == 200, r.text
        line = r.json()
        ids, turn = line["token_ids"], line["turns"][1]
        want = []
        for out in TOOL_OUTPUTS:  # the one token range of turn 1's prompt that is the content, alone
            found = _exact_ranges(tok, ids, turn["prompt_start"], turn["output_start"], out)
            assert len(found) == 1, (out, found)
            want.append(list(found[0]))
        assert line["tool_spans"] == want
        assert line["tool_spans_unknown"] == []
        assert not any(ids[a:b] and line["loss_mask"][a] for a, b in want)  # prompt tokens, never sampled
        # a turn whose committed prompt no render reproduces (here its closing token
        # differs) is unknown, and none of its tokens is marked: a span is never a guess
        s = live_apps[st.url].state.ctx.store.get(sid)
        snap = _snapshot(s, 0)
        snap["ids"][turn["output_start"] - 1] += 1
        other = orjson.loads(_body(sid + "-other", live_apps[st.url].state.ctx.codec, snap))
        assert other["tool_spans_unknown"] == [1] and other["tool_spans"] == [], other["tool_spans"]


class _FlakyCodec:
    """The server's codec, but its renders raise while `failing`: a transient failure."""

    def __init__(self, codec: Any) -> None:
        self.codec, self.failing = codec, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.codec, name)

    def bridge(self, *args: Any, **kwargs: Any) -> Any:
        if self.failing:
            raise RuntimeError("render failed this time")
        return self.codec.bridge(*args, **kwargs)

    def render_first(self, *args: Any, **kwargs: Any) -> Any:
        if self.failing:
            raise RuntimeError("render failed this time")
        return self.codec.render_first(*args, **kwargs)


async def test_a_tool_span_render_that_raised_is_not_kept_as_unknown(qwen3_dir: Path) -> None:
    """The line's tool spans are kept per turn; a turn unknown because its render raised
    is not kept so: the next read renders it again and marks its tool output."""
    async with live_stack(qwen3_dir, script=TOOL_SCRIPT) as st:
        sid = await tool_session(st)
        s = live_apps[st.url].state.ctx.store.get(sid)
        codec = _FlakyCodec(live_apps[st.url].state.ctx.codec)
        first = orjson.loads(_body(sid, codec, _snapshot(s, 0)))
        assert first["tool_spans_unknown"] == [1] and first["tool_spans"] == []
        codec.failing = False
        again = orjson.loads(_body(sid, codec, _snapshot(s, 0)))
        assert again["tool_spans_unknown"] == [] and len(again["tool_spans"]) == len(TOOL_OUTPUTS), again


async def test_a_branch_discarded_while_the_line_waits_for_the_session_lock_is_a_400_not_a_500(
        qwen3_dir: Path) -> None:
    """A fork commit whose journal append fails discards its new branch (`tree.discard`)
    under the session lock: a `/line` of that branch that was waiting for the lock finds
    it gone there and answers the typed 400, never a raw 500."""
    async with live_stack(qwen3_dir, script=[{"content": "ok"}]) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
        assert r.status_code == 200, r.text
        s = live_apps[st.url].state.ctx.store.get(sid)
        async with s.lock:  # a fork commit in progress
            fork = s.tree.branch_from(0, 0, "rewrite")
            got = asyncio.create_task(st.http.get(f"/sessions/{sid}/line", params={"branch": fork.id}))
            while not s.lock._waiters:  # the request passed any check made before the lock, and waits
                await asyncio.sleep(0.01)
            s.tree.discard(fork.id, 0)  # its journal append failed: the branch is undone
        r = await got
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request", r.text


async def test_the_lines_arrays_are_copies_not_views_of_the_live_buffer(qwen3_dir: Path) -> None:
    """The line is serialised after the session lock is released, and an undone commit
    followed by another rewrites the buffer's positions in place: what `/line` sends is
    copied under the lock, even for a one-segment line (whose gather is a view)."""
    async with live_stack(qwen3_dir, script=[{"content": "ok"}]) as st:
        sid = await st.session()
        r = await st.chat(sid, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
        assert r.status_code == 200, r.text
        s = live_apps[st.url].state.ctx.store.get(sid)
        snap = _snapshot(s, 0)
        live = s.tree.get(0).trajectory.arrays()
        assert len(snap["ids"]) == len(live[0]) > 0
        for key, arr in zip(("ids", "logprobs", "mask"), live, strict=True):
            assert not np.shares_memory(snap[key], arr), key
