"""The trajectory viewer in a real headless Chromium (Debian's `chromium`, driven by
Playwright): one session with a retry, a fork, a pause with a weight-version change and
a history rewrite, seen on its pages; the live turn growing; model output shown as text.

Screenshots of each page are taken on every run; they go to `docs/screenshots/` (linked
from the README) when `TITO_SCREENSHOTS=docs/screenshots` is set, else to a temporary
folder, so a test run leaves the checkout as it found it. Without
/usr/bin/chromium the tests skip here; under CI (`CI` set) that is a failure: `.ci/run`
installs it, and a browser suite that silently skips proves nothing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from session_server.context import Settings
from trajectory.export import branch_line

from ..stack import Stack, live_stack, until_in_flight
from .test_viewer_data import TOOL_SCRIPT, tool_session

CHROMIUM = os.environ.get("TITO_CHROMIUM", "/usr/bin/chromium")
SHOTS = (Path(os.environ["TITO_SCREENSHOTS"]).resolve() if os.environ.get("TITO_SCREENSHOTS")
         else Path(tempfile.mkdtemp(prefix="tito-screenshots-")))
EVIL = "<script>window.__pwned = 1</script><img src=x onerror=window.__pwned=2>"
SCRIPT = [
    {"reasoning_content": "Look at the config first.", "content": f"Reading it. {EVIL} " + "ok " * 30},
    {"content": "Second answer: " + "step " * 60},
]
U1 = [{"role": "user", "content": "The tests fail after the config change. Fix it."}]


def _browser_or_skip() -> Any:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        if os.environ.get("CI"):
            pytest.fail(f"CI: no Chromium at {CHROMIUM}: .ci/run installs Debian's chromium")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set TITO_CHROMIUM)")
    return async_playwright


async def _scene(st: Stack) -> str:
    """turn 0; turn 1 paused mid-output while the weights go v1 -> v2 (and the template
    would re-render turn 0: a history rewrite); a retry of turn 1 (rollback); a fork (the
    agent edits its own earlier answer)."""
    assert (await st.http.post("/control/weight_version", json={"version": 1})).status_code == 200
    async with httpx.AsyncClient() as sim:
        await sim.post(f"{st.engines[0]}/sim/weight_version", json={"version": 1})
        sid = await st.session(metadata={"task": "viewer-demo"})
        r = await st.chat(sid, {"messages": U1, "max_tokens": 200})
        a1 = r.json()["choices"][0]["message"]
        msgs = [*U1, {"role": "assistant", "content": a1["content"], "reasoning_content": a1.get("reasoning_content")},
                {"role": "user", "content": "Go on."}]
        chat = asyncio.create_task(st.chat(sid, {"messages": msgs, "max_tokens": 200}))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.05)
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
        await sim.post(f"{st.engines[0]}/sim/weight_version", json={"version": 2})
        assert (await st.http.post("/control/weight_version", json={"version": 2})).status_code == 200
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        assert (await chat).status_code == 200
    assert (await st.chat(sid, {"messages": msgs, "max_tokens": 40})).status_code == 200  # the retry
    forked = [*U1, {"role": "assistant", "content": "An edited answer."}, {"role": "user", "content": "Again."}]
    assert (await st.chat(sid, {"messages": forked, "max_tokens": 40})).status_code == 200
    return sid


async def _page(browser: Any, url: str) -> Any:
    """A page without the viewer's Content-Security-Policy (Playwright's waits evaluate
    strings, which it forbids): the escaping alone must keep model output inert here."""
    page = await browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    await page.goto(url)
    await page.wait_for_selector("body[data-ready='1']")
    return page


async def test_session_page_shows_tree_tokens_versions_samples_and_escapes_model_output(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=3, script=SCRIPT) as st:
        await _check_session_pages(st, await _scene(st))


async def _check_session_pages(st: Stack, sid: str) -> None:
    traj = await st.trajectory(sid)
    branches = {b["id"]: b for b in traj["branches"]}
    reasons = sorted(b["reason"] for b in branches.values())
    assert reasons == ["first_turn_resent", "rollback", "root"], reasons  # the scene has what the test claims
    root = branches[0]
    spans = root["turns"][1]["weight_spans"]
    assert [v for _, _, v in spans] == [1, 2], spans
    samples = (await st.http.get(f"/sessions/{sid}/samples")).json()["samples"]
    kept = sorted(s["path"][-1] for s in samples)
    async with _browser_or_skip()() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = await _page(browser, f"{st.url}/ui/sessions/{sid}?branch=0")
            # the branch tree: one node per branch, with its fork reason and the picker's kept lines
            nodes = page.locator("#branch-tree .node")
            assert await nodes.count() == 3
            got = {int(await n.get_attribute("data-branch")): await n.get_attribute("data-reason")
                   for n in await nodes.all()}
            assert got == {b["id"]: b["reason"] for b in branches.values()}
            kept_ui = sorted([int(await n.get_attribute("data-branch")) for n in await nodes.all()
                              if await n.locator(".badge.kept").count()])
            assert kept_ui == kept
            assert await page.locator("#samples .sample").count() == len(samples)
            # the token view: every token, classed by the loss mask
            await page.wait_for_function(
                "document.querySelectorAll('#line-tokens .chunk').length > 0 && "
                "[...document.querySelectorAll('#line-tokens .chunk')].every(c => c.dataset.loaded)")
            n_tok = await page.locator("#line-tokens .tok").count()
            assert n_tok == len(root["token_ids"])
            assert await page.locator("#line-tokens .tok.sampled").count() == sum(root["loss_mask"])
            repair = sum(t["repair_tokens"] for t in root["turns"])
            assert await page.locator("#line-tokens .tok.repair").count() == repair
            # the version boundary sits right before the first token sampled under v2
            at = await page.locator("#line-tokens .mark.version").first.get_attribute("data-at")
            assert int(at) == spans[1][0]
            nxt = page.locator("#line-tokens .mark.version").first.locator("xpath=following-sibling::span[contains(@class,'tok')][1]")
            assert int(await nxt.get_attribute("data-i")) == spans[1][0]
            aborted = [sg for t in root["turns"] for sg in t["extra"].get("segments", []) if sg["ended"] == "abort"]
            assert len(aborted) == 1  # the scene's one pause mid-output
            assert await page.locator("#line-tokens .mark.abort").count() == len(aborted)
            # the history rewrite's first differing token is marked
            first_diff = root["turns"][1]["extra"]["history_rewrite"]["first_diff"]
            assert int(await page.locator("#line-tokens .tok.rewrite").get_attribute("data-i")) == first_diff
            # model output with markup is text: nothing ran, no element was made from it
            assert await page.evaluate("window.__pwned === undefined")
            assert await page.locator("#line-tokens script, #line-tokens img").count() == 0
            text = await page.locator("#line-tokens").inner_text()
            assert "<script>" in text.replace("↵", "")
            SHOTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(SHOTS / "session.png"), full_page=True)
            # the conversation view: messages as sent, each answer linked to its tokens
            await page.click("button[data-tab='conversation']")
            conv = page.locator("#conversation")
            assert EVIL in await conv.inner_text()
            assert await conv.locator("script, img").count() == 0
            links = conv.locator("a.to-tokens")
            assert [int(await a.get_attribute("data-at")) for a in await links.all()] == \
                [t["output_start"] for t in root["turns"]]
            await page.screenshot(path=str(SHOTS / "conversation.png"), full_page=True)
            # the list and the control page
            page = await _page(browser, f"{st.url}/ui?meta=task=viewer-demo")
            assert await page.locator("tr.session-row").count() == 1
            assert sid in await page.locator("#session-table").inner_text()
            await page.screenshot(path=str(SHOTS / "sessions.png"), full_page=True)
            page = await _page(browser, f"{st.url}/ui/control")
            rows = {await r.locator("th").inner_text(): await r.locator("td").inner_text()
                    for r in await page.locator("#control-state tr").all()}
            assert rows["weight version"] == "2" and rows["paused"] == "false", rows  # set to 2, resumed
            assert rows["in flight"] == "0", rows
            assert await page.locator("#engines tr").count() == 2
            await page.screenshot(path=str(SHOTS / "control.png"), full_page=True)
        finally:
            await browser.close()


async def _all_loaded(page: Any) -> None:
    await page.wait_for_function(
        "document.querySelectorAll('#line-tokens .chunk').length > 0 && "
        "[...document.querySelectorAll('#line-tokens .chunk')].every(c => c.dataset.loaded)")


async def test_a_forked_branch_shows_its_whole_line_with_its_parents_prefix(qwen3_dir: Path) -> None:
    """A branch's token view is its whole line, the parent's tokens up to the fork point
    and then its own, each position with the line's own mask, logprob and turn marks,
    and its conversation is the whole line's turns, the parent's before the fork point
    among them (the export holds a branch's own part only; `branch_line` stitches the
    line here)."""
    async with live_stack(qwen3_dir, latency_ms=3, script=SCRIPT) as st:
        sid = await _scene(st)
        traj = await st.trajectory(sid)
        forks = [b for b in traj["branches"] if b["parent_id"] is not None]
        assert any(b["fork_index"] > 0 for b in forks)  # one shares a prefix with its parent (the retry)
        # and so has turns of its parent's in its line, which its own part does not hold
        assert any(len(branch_line(traj, b["id"])["turns"]) > len(b["turns"]) for b in forks)
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                for b in forks:
                    full = branch_line(traj, b["id"])
                    page = await _page(browser, f"{st.url}/ui/sessions/{sid}?branch={b['id']}")
                    await _all_loaded(page)
                    toks = page.locator("#line-tokens .tok")
                    assert await toks.count() == len(full["token_ids"]), b["reason"]
                    sampled = [int(i) for i in await page.locator("#line-tokens .tok.sampled").evaluate_all(
                        "els => els.map(e => e.dataset.i)")]
                    assert sampled == [i for i, m in enumerate(full["loss_mask"]) if m], b["reason"]
                    turns = full["turns"]
                    at = [int(x) for x in await page.locator("#line-tokens .mark.turn").evaluate_all(
                        "els => els.map(e => e.dataset.at)")]
                    assert at == [t["prompt_start"] for t in turns], b["reason"]
                    versions = sum(len(t["weight_spans"]) - 1 for t in turns)
                    assert await page.locator("#line-tokens .mark.version").count() == versions
                    for t in turns:  # each turn's first sampled token: the line's logprob and version
                        i = t["output_start"]
                        title = await page.locator(f"#line-tokens .tok[data-i='{i}']").get_attribute("title")
                        assert f"id {full['token_ids'][i]} " in title, title
                        assert f"logprob {full['logprobs'][i]:.4f}" in title, title
                        assert f"weights v{t['weight_spans'][0][2]}" in title, title
                    # the conversation tab: every turn of the line, each answer linked to its tokens
                    await page.click("button[data-tab='conversation']")
                    links = [int(x) for x in await page.locator("#conversation .to-tokens").evaluate_all(
                        "els => els.map(e => e.dataset.at)")]
                    assert links == [t["output_start"] for t in turns if t["assistant_message"]], b["reason"]
                    assert U1[0]["content"] in await page.locator("#conversation .msg.user").first.inner_text()
            finally:
                await browser.close()


async def test_tool_results_tokens_show_as_tool_output(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, script=TOOL_SCRIPT) as st:
        sid = await tool_session(st)
        line = (await st.http.get(f"/sessions/{sid}/line", params={"branch": 0})).json()
        n_tool = sum(b - a for a, b in line["tool_spans"])
        assert n_tool > 0
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                await _all_loaded(page)
                got = [int(i) for i in await page.locator("#line-tokens .tok.tool").evaluate_all(
                    "els => els.map(e => e.dataset.i)")]
                assert got == [i for a, b in line["tool_spans"] for i in range(a, b)]
                assert f"tool output {n_tool}" in await page.locator("#token-summary").inner_text()
            finally:
                await browser.close()


async def test_live_turn_grows_in_the_page_as_it_is_sampled(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=15, script=[{"content": "slow " * 80}]) as st:
        sid = await st.session()
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                await page.wait_for_function("document.getElementById('status').textContent.startsWith('live')")
                chat = asyncio.create_task(st.chat(sid, {"messages": U1, "max_tokens": 120, "stream": True}))
                await page.wait_for_selector("#live-turn .tok")
                first = await page.locator("#live-turn .tok").count()
                await page.wait_for_function(f"document.querySelectorAll('#live-turn .tok').length > {first + 5}")
                await page.screenshot(path=str(SHOTS / "live.png"))
                assert (await chat).status_code == 200
                await page.wait_for_function("document.querySelectorAll('#line-tokens .tok').length > 0")
            finally:
                await browser.close()


async def test_a_page_opened_mid_turn_shows_the_turn_so_far(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=15, script=[{"content": "slow " * 80}]) as st:
        sid = await st.session()
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                async with st.http.stream("POST", f"/sessions/{sid}/v1/chat/completions",
                                          json={"messages": U1, "max_tokens": 120, "stream": True}) as turn:
                    lines = turn.aiter_lines()
                    for _ in range(20):  # a few tokens in before the page opens
                        await anext(lines)
                    page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                    await page.wait_for_selector("#live-turn .tok")
                    shown = await page.locator("#live-turn .tok").count()
                    assert shown >= 5, shown  # the tokens sampled before it opened, from `hello`
                    assert "branch 0" in await page.locator("#live h2").inner_text()
                    async for _ in lines:
                        pass
            finally:
                await browser.close()


async def test_an_abort_without_a_version_change_is_marked_at_the_token_where_the_engine_stopped(
        qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=4, script=[{"content": "step " * 150}]) as st, \
            httpx.AsyncClient() as sim:
        sid = await st.session()
        chat = asyncio.create_task(st.chat(sid, {"messages": U1, "max_tokens": 200}))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.08)
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
        await asyncio.sleep(0.03)
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        assert (await chat).status_code == 200
        log = (await sim.get(f"{st.engines[0]}/sim/requests")).json()
        turn = (await st.trajectory(sid))["branches"][0]["turns"][0]
        assert [r["finish_reason"] for r in log][:1] == ["abort"] and len(log) == 2, log
        assert len(turn["weight_spans"]) == 1  # one version: no version boundary tells where it was cut
        at = turn["output_start"] + len(log[0]["output_ids"])  # the first token of the resubmission
        assert turn["extra"]["segments"][0]["end"] == len(log[0]["output_ids"])
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                await page.wait_for_selector("#line-tokens .mark.abort")
                marks = page.locator("#line-tokens .mark.abort")
                assert await marks.count() == 1
                assert int(await marks.first.get_attribute("data-at")) == at
                nxt = marks.first.locator("xpath=following-sibling::span[contains(@class,'tok')][1]")
                assert int(await nxt.get_attribute("data-i")) == at
                assert await page.locator("#line-tokens .mark.version").count() == 0
            finally:
                await browser.close()


async def test_a_non_streamed_turn_grows_in_the_page_before_it_commits(qwen3_dir: Path) -> None:
    """The client asks without `stream`: the watching page still sees the engine's tokens
    as they are sampled (vLLM: its stream frames are deltas), and the client's answer and
    the trajectory are an unwatched turn's."""
    async with live_stack(qwen3_dir, "vllm", latency_ms=15, script=[{"content": "slow " * 80}] * 2) as st:
        ref_sid = await st.session()
        ref = await st.chat(ref_sid, {"messages": U1, "max_tokens": 120})
        sid = await st.session()
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                await page.wait_for_function("document.getElementById('status').textContent.startsWith('live')")
                chat = asyncio.create_task(st.chat(sid, {"messages": U1, "max_tokens": 120}))
                await page.wait_for_selector("#live-turn .tok")
                first = await page.locator("#live-turn .tok").count()
                await page.wait_for_function(f"document.querySelectorAll('#live-turn .tok').length > {first + 5}")
                assert not chat.done()  # tokens grew while the client still waited for its one answer
                got = await chat
                assert got.status_code == 200
                await page.wait_for_function("document.querySelectorAll('#line-tokens .tok').length > 0")
            finally:
                await browser.close()
        assert got.json()["choices"] == ref.json()["choices"]
        a, b = (await st.trajectory(sid))["branches"][0], (await st.trajectory(ref_sid))["branches"][0]
        for key in ("token_ids", "loss_mask", "logprobs"):
            assert a[key] == b[key], key


async def test_pages_and_data_need_the_admin_token_and_login_sets_a_read_only_cookie(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(admin_token="T0ken")) as st:
        admin = {"Authorization": "Bearer T0ken"}
        sid = (await st.http.post("/sessions", json={}, headers=admin)).json()["session_id"]
        async with httpx.AsyncClient(base_url=st.url) as anon:
            for path in ("/ui/api/sessions", f"/sessions/{sid}/tokens?branch=0", f"/sessions/{sid}/live",
                         "/ui/static/session.js"):
                assert (await anon.get(path)).status_code == 401, path
            r = await anon.get(f"/ui/sessions/{sid}")
            assert r.status_code == 303 and r.headers["location"] == f"/ui/login?next=/ui/sessions/{sid}"
            assert (await anon.post("/ui/login", data={"token": "wrong"})).status_code == 403
            r = await anon.post("/ui/login", data={"token": "T0ken", "next": "//evil.example/"})
            assert r.status_code == 303 and r.headers["location"] == "/ui"  # no open redirect
            assert "T0ken" not in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
            page = await anon.get(f"/ui/sessions/{sid}")  # with the cookie: the page, under its policy
            assert page.status_code == 200
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp, csp
            assert "frame-ancestors 'none'" in csp and page.headers["x-content-type-options"] == "nosniff"
            assert (await anon.get("/ui/api/sessions")).status_code == 200  # the cookie reads
            assert (await anon.post("/control/pause", json={})).status_code == 401  # and changes nothing
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                refused: list[str] = []  # every read the cookie is refused: a route missing from VIEWER_ROUTES
                page.on("response", lambda r: refused.append(r.url) if r.status == 401 else None)
                await page.goto(f"{st.url}/ui/sessions/{sid}")
                assert "/ui/login" in page.url
                refused.clear()  # the page load before the login
                await page.fill("#token", "T0ken")
                await page.click("button[type='submit']")
                await page.wait_for_selector("body[data-ready='1']")
                assert page.url.endswith(f"/ui/sessions/{sid}")
                assert await page.locator("#branch-tree .node").count() == 1
                await page.wait_for_selector("#token-summary")  # the line's own read is done
                for path in ("/ui", "/ui/control"):
                    await page.goto(f"{st.url}{path}")
                    await page.wait_for_selector("body[data-ready='1']")
                assert refused == []
            finally:
                await browser.close()


SPLIT = "naïve 😀 世界 "  # characters the offline byte-level BPE splits over several tokens
MAX_TOKEN_ELEMENTS = 10_000


async def long_line_session(st: Stack, words: int = 24_000) -> str:
    """A session whose line holds ~100K tokens: one turn with a huge prompt (a long
    document an agent pasted), split characters included."""
    sid = await st.session()
    doc = "".join(f"line {k} of the pasted log {SPLIT}\n" for k in range(words // 8))
    r = await st.chat(sid, {"messages": [{"role": "user", "content": doc}], "max_tokens": 16})
    assert r.status_code == 200, r.text
    return sid


async def test_a_100k_token_line_keeps_few_token_elements_loads_its_end_and_answers_clicks(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await long_line_session(st)
        line = (await st.trajectory(sid))["branches"][0]
        n = len(line["token_ids"])
        assert n >= 90_000, n  # the scene is the size the test claims
        last = (await st.http.get(f"/sessions/{sid}/tokens", params={"branch": 0, "start": n - 50, "end": n})).json()
        async with _browser_or_skip()() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await _page(browser, f"{st.url}/ui/sessions/{sid}")
                await page.wait_for_selector("#line-tokens .chunk[data-loaded='1']")
                assert f"{n} tokens" in await page.locator("#token-summary").inner_text()  # the full count
                box = page.locator("#line-tokens")
                # scroll through the whole line in steps, as a reader dragging the bar would
                height = await box.evaluate("b => b.scrollHeight")
                most = 0
                for k in range(1, 21):
                    await box.evaluate(f"b => {{ b.scrollTop = {height * k // 20}; }}")
                    await page.wait_for_timeout(100)
                    most = max(most, await page.locator("#line-tokens .tok").count())
                await box.evaluate("b => { b.scrollTop = b.scrollHeight; }")
                await page.wait_for_selector(f"#line-tokens .tok[data-i='{n - 1}']")
                most = max(most, await page.locator("#line-tokens .tok").count())
                assert most < MAX_TOKEN_ELEMENTS, most  # bounded however far it was scrolled
                # the last tokens are the data route's, position by position
                got = [await page.locator(f"#line-tokens .tok[data-i='{i}']").text_content() for i in range(n - 50, n)]
                assert [t.replace("↵", "").replace("→", "") for t in got] == last["texts"]
                # a split character shows whole on the token completing it, never U+FFFD
                text = await box.inner_text()
                assert "😀" in text and "世界" in text and "\ufffd" not in text
                # the page still answers: a click on a token shows its facts
                tok = page.locator(f"#line-tokens .tok[data-i='{n - 1}']")
                await tok.click()
                await page.wait_for_function(
                    f"document.getElementById('token-detail').textContent.startsWith('#{n - 1} id ')")
                await page.screenshot(path=str(SHOTS / "long-line.png"))
            finally:
                await browser.close()
