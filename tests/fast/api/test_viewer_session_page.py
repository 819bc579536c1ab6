"""The session page in a real headless Chromium, as a reader uses it while the agent
runs: a turn's end updates the page in place (the open tab, the token box's scroll
position, the clicked token and every unchanged chunk's elements stay), and the
samples' exactly-once line is the page's own count, the same as one made here from
`GET /sessions/{sid}/samples`, problems listed when the samples break it; a turn that
ended while the live stream reconnected still shows."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from session_server.api import ui_data

from ..stack import Stack, live_stack
from .test_viewer_pages import CHROMIUM, U1, _browser_or_skip, _page, _scene

WORDS = {"content": "word " * 300}


async def _agent_turn(st: Stack, sid: str, msgs: list[dict[str, Any]]) -> None:
    """One more turn of the agent through the server's HTTP API: its answer, then a user turn."""
    r = await st.chat(sid, {"messages": msgs, "max_tokens": 400})
    assert r.status_code == 200, r.text
    msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Go on."}]


async def _read_again(page: Any, reads: int, tokens: int) -> None:
    """Until the page read the session `reads` times after it opened and shows `tokens`."""
    await page.wait_for_function(
        f"Number(document.body.dataset.reads || 0) >= {reads} && "
        f"document.getElementById('token-summary').textContent.startsWith('{tokens} tokens')")


async def test_a_turns_end_updates_the_page_in_place_keeping_tab_scroll_clicked_token_and_unchanged_chunks(
        qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=1, script=[WORDS]) as st:
        sid = await st.session()
        msgs = list(U1)
        for _ in range(4):
            await _agent_turn(st, sid, msgs)
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                await page.wait_for_function("document.getElementById('status').textContent.startsWith('live')")
                await page.wait_for_selector("#line-tokens .chunk[data-loaded='1']")
                # a JS property on every chunk and on each loaded chunk's first token: a node
                # drawn again (or a reloaded page) does not have it
                old = await page.evaluate("""() => {
                    window.__same_page = 1;
                    return [...document.querySelectorAll('#line-tokens .chunk')].map((c, k) => {
                        c.__tag = k; const t = c.querySelector('.tok'); if (t) t.__tag = k; return !!t; });
                }""")
                assert len(old) >= 6 and any(old), old
                # click a token, then scroll the token box
                await page.locator("#line-tokens .tok[data-i='3']").click()
                detail = await page.locator("#token-detail").inner_text()
                assert detail.startswith("#3 id "), detail
                box = page.locator("#line-tokens")
                assert await box.evaluate("b => b.scrollHeight - b.clientHeight") > 400  # it can scroll
                await box.evaluate("b => { b.scrollTop = 300; }")
                scroll = await box.evaluate("b => b.scrollTop")
                assert scroll == 300

                await _agent_turn(st, sid, msgs)  # the agent's next turn, while the page is open
                line = (await st.trajectory(sid))["branches"][0]
                await _read_again(page, 1, len(line["token_ids"]))
                assert await page.evaluate("window.__same_page === 1")  # not reloaded
                kept = await page.evaluate("""(n) => {
                    const cs = [...document.querySelectorAll('#line-tokens .chunk')];
                    return {tags: cs.slice(0, n).map((c) => c.__tag), count: cs.length,
                            toks: cs.slice(0, n).map((c) => { const t = c.querySelector('.tok'); return t ? t.__tag : null; }),
                            starts: cs.map((c) => Number(c.dataset.start))};
                }""", len(old))
                assert kept["tags"] == list(range(len(old)))  # every old chunk is the same node
                # and every old chunk but the line's old last one (drawn again: its end moved) keeps its tokens
                assert [t for t, was in zip(kept["toks"][:-1], old[:-1], strict=True) if was] == \
                    [k for k, was in enumerate(old[:-1]) if was]
                new_turn = line["turns"][-1]
                assert kept["count"] > len(old) and new_turn["prompt_start"] in kept["starts"]  # the new turn shows
                assert await box.evaluate("b => b.scrollTop") == scroll
                assert await page.locator("#token-detail").inner_text() == detail
                assert await page.locator("#line-tokens .tok.picked").get_attribute("data-i") == "3"
                assert not await page.locator("#tokens-pane").is_hidden()

                # the conversation tab open: a turn's end keeps it open and adds the new turn's messages
                await page.click("button[data-tab='conversation']")
                first = await page.evaluate("() => { const m = document.querySelector('#conversation .msg'); m.__tag = 1; "
                                            "return document.querySelectorAll('#conversation .msg').length; }")
                await _agent_turn(st, sid, msgs)
                line = (await st.trajectory(sid))["branches"][0]
                await _read_again(page, 2, len(line["token_ids"]))
                assert await page.locator("#conversation-pane").is_visible()
                assert await page.locator("#tokens-pane").is_hidden()
                assert await page.locator("button[data-tab='conversation']").get_attribute("class") == "on"
                assert await page.evaluate("document.querySelector('#conversation .msg').__tag === 1")
                assert await page.locator("#conversation .msg").count() > first
                assert "word word" in await page.locator("#conversation .msg.assistant").last.inner_text()
                assert await page.evaluate("window.__same_page === 1")
                assert errors == []
            finally:
                await browser.close()


async def test_a_turn_that_ends_while_the_live_stream_reconnects_is_shown(
        qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server ends a live stream after MAX_LIVE_S and EventSource reconnects: a turn
    committed while no stream is open sends its `end` to nobody, so the page compares the
    session's committed turns in the new stream's `hello` with what it last drew, and
    reads the session again when they differ."""
    monkeypatch.setattr(ui_data, "MAX_LIVE_S", 0.5)
    monkeypatch.setattr(ui_data, "KEEPALIVE_S", 0.1)
    async with live_stack(qwen3_dir, latency_ms=1, script=[WORDS]) as st:
        sid = await st.session()
        msgs = list(U1)
        await _agent_turn(st, sid, msgs)
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                await page.wait_for_function("document.getElementById('status').textContent.startsWith('live')")
                # no stream can open: the one open ends (MAX_LIVE_S) and a reconnect fails
                await page.route("**/live", lambda route: route.abort())
                async with page.expect_event("requestfailed", lambda r: r.url.endswith("/live"), timeout=30_000):
                    pass
                await _agent_turn(st, sid, msgs)  # its `end` reaches no viewer
                assert await page.evaluate("Number(document.body.dataset.reads || 0)") == 0
                await page.unroute("**/live")
                line = (await st.trajectory(sid))["branches"][0]
                await _read_again(page, 1, len(line["token_ids"]))
            finally:
                await browser.close()


def counted(samples: list[dict[str, Any]]) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(sampled tokens, those trained once, [(position, owner, count)] of the others), counted
    from the samples alone: a turn's sampled tokens are its output range, owned by the
    branch its diagnostics name."""
    count: Counter[tuple[int, int]] = Counter()
    for s in samples:
        for (_, start, end), diag in zip(s["turn_boundaries"], s["diagnostics"], strict=True):
            for p in range(start, end):
                count[(diag["branch"], p)] += s["loss_mask"][p]
    bad = sorted((p, owner, c) for (owner, p), c in count.items() if c != 1)
    return len(count), sum(1 for c in count.values() if c == 1), bad


async def _coverage_of(page: Any) -> tuple[int, int, list[tuple[int, int, int]]]:
    cov = page.locator("#samples-coverage")
    items = [(int(await li.get_attribute("data-at")), int(await li.get_attribute("data-line")),
              int(await li.get_attribute("data-count"))) for li in await page.locator("#coverage-problems li").all()]
    return int(await cov.get_attribute("data-sampled")), int(await cov.get_attribute("data-once")), items


async def test_the_pages_exactly_once_count_is_the_samples_own_and_lists_a_double_count_and_a_gap(
        qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=3, script=[{"content": "Reading it. " + "ok " * 30},
                                                           {"content": "Second answer: " + "step " * 60}]) as st:
        sid = await _scene(st)
        samples = (await st.http.get(f"/sessions/{sid}/samples", params={"picker": "all"})).json()["samples"]
        assert len(samples) == 3  # the scene: the root line, its retry (sharing turn 0) and a fork
        want = counted(samples)
        assert want[2] == [] and want[0] == want[1] > 100
        shared = next(s for s in samples if s["path"] == [0, 1])
        assert shared["diagnostics"][0]["branch"] == 0  # turn 0 is the root's, in the retry's line too
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}?picker=all")
                assert await _coverage_of(page) == want
                assert (await page.locator("#samples-coverage").inner_text()).startswith("exactly once")

                # the same page over samples that break it: turn 0's first 3 tokens trained again
                # in the retry's sample, and the fork's first sampled token trained nowhere
                bad = copy.deepcopy(samples)
                retry = next(s for s in bad if s["path"] == [0, 1])
                _, start, _ = retry["turn_boundaries"][0]
                retry["loss_mask"][start:start + 3] = [1, 1, 1]
                fork = next(s for s in bad if s["path"][-1] == 2)  # its parent is the retry, at checkpoint 0
                fork["loss_mask"][fork["turn_boundaries"][0][1]] = 0
                want = counted(bad)
                assert len(want[2]) == 4  # what the test claims: three counted twice, one never
                body = json.dumps({"format": "tito-samples", "version": 1, "samples": bad})
                page = await browser.new_page(bypass_csp=True)
                await page.route(f"**/sessions/{sid}/samples?*",
                                 lambda route: route.fulfill(status=200, content_type="application/json", body=body))
                await page.goto(f"{st.url}/ui/sessions/{sid}?picker=all")
                await page.wait_for_selector("body[data-ready='1']")
                assert await _coverage_of(page) == want
                assert (await page.locator("#samples-coverage").inner_text()).startswith("NOT exactly once")
            finally:
                await browser.close()
