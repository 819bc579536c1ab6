"""The trajectory viewer at scale: a ~100K-token line in a real Chromium, and the
session list over 10,000 sessions.

(a) One session whose line holds ~100K tokens (one turn with a pasted log as its
prompt, split UTF-8 characters included), opened in headless Chromium (Debian's
`/usr/bin/chromium`, driven by Playwright): time from navigation to the first token
element painted, the page's long tasks (`PerformanceObserver('longtask')`, which
Chromium exposes: main-thread tasks over 50 ms), the most token elements the page held
while it was scrolled through end to end in 20 steps, the time from a jump to the end
until the last token is in the page, and from a click on a token until its facts show.

(b) 10,000 sessions created through `POST /sessions` (64 at a time, metadata `task`
one of 10 values), then `GET /ui/api/sessions`: the first page, a filtered page
(`meta=task=t3`: 1,000 match) and the last page, 50 rows each, median of `--reps`.

The server and the simulated engine are separate processes (bench/_procs.py).

    python bench/viewer.py --json bench/results/viewer.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._procs import server, sim_engine  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402

CHROMIUM = os.environ.get("TITO_CHROMIUM", "/usr/bin/chromium")
SPLIT = "naïve 😀 世界 "
LONGTASKS = """
window.__longtasks = [];
try {
  new PerformanceObserver((l) => { for (const e of l.getEntries()) window.__longtasks.push(e.duration); })
    .observe({ type: "longtask", buffered: true });
  window.__longtask_supported = true;
} catch (e) { window.__longtask_supported = false; }
"""


async def long_line(url: str, words: int) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        sid = (await http.post("/sessions", json={})).json()["session_id"]
        doc = "".join(f"line {k} of the pasted log {SPLIT}\n" for k in range(words // 8))
        r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": doc}], "max_tokens": 16})
        r.raise_for_status()
        t0 = time.perf_counter()
        traj = await http.get(f"/sessions/{sid}/trajectory")
        traj_s = time.perf_counter() - t0
        n = len(traj.json()["branches"][0]["token_ids"])
        t0 = time.perf_counter()
        (await http.get(f"/sessions/{sid}/tokens", params={"branch": 0, "start": 0, "end": 2000})).raise_for_status()
        chunk_s = time.perf_counter() - t0
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
            await page.add_init_script(LONGTASKS)
            await page.goto(f"{url}/ui/sessions/{sid}")
            first = await (await page.wait_for_function(
                "() => document.querySelector('#line-tokens .tok') ? performance.now() : false",
                polling="raf", timeout=120_000)).json_value()
            await page.wait_for_selector("body[data-ready='1']")
            load_tasks = await page.evaluate("window.__longtasks.slice()")
            box = page.locator("#line-tokens")
            height = await box.evaluate("b => b.scrollHeight")
            most = 0
            for k in range(1, 21):
                await box.evaluate(f"b => {{ b.scrollTop = {height * k // 20}; }}")
                await page.wait_for_timeout(150)
                most = max(most, await page.locator("#line-tokens .tok").count())
            await box.evaluate("b => { b.scrollTop = 0; }")
            await page.wait_for_timeout(300)
            jump = await page.evaluate(f"""() => new Promise((done) => {{
                const b = document.getElementById('line-tokens'), t0 = performance.now();
                b.scrollTop = b.scrollHeight;
                const look = () => document.querySelector("#line-tokens .tok[data-i='{n - 1}']")
                  ? done(performance.now() - t0) : requestAnimationFrame(look);
                look(); }})""")
            most = max(most, await page.locator("#line-tokens .tok").count())
            click = await page.evaluate(f"""() => new Promise((done) => {{
                const d = document.getElementById('token-detail'), t0 = performance.now();
                document.querySelector("#line-tokens .tok[data-i='{n - 1}']").click();
                const look = () => d.textContent.startsWith('#{n - 1} ') ? done(performance.now() - t0) : requestAnimationFrame(look);
                look(); }})""")
            all_tasks = await page.evaluate("window.__longtasks.slice()")
            supported = await page.evaluate("window.__longtask_supported")
        finally:
            await browser.close()
    return {
        "tokens": n, "trajectory_get_s": round(traj_s, 3), "tokens_get_2000_s": round(chunk_s, 4),
        "first_token_paint_ms": round(first, 1), "scroll_to_end_ms": round(jump, 1), "click_to_detail_ms": round(click, 1),
        "max_token_elements": most, "longtask_supported": supported,
        "longtasks_during_load_ms": [round(x, 1) for x in load_tasks],
        "longest_task_ms": round(max(all_tasks, default=0.0), 1), "longtasks_total": len(all_tasks),
        "longtasks_after_load_ms": [round(x, 1) for x in all_tasks[len(load_tasks):]],
    }


async def many_sessions(url: str, count: int, reps: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        sem = asyncio.Semaphore(64)

        async def make(k: int) -> None:
            async with sem:
                (await http.post("/sessions", json={"metadata": {"task": f"t{k % 10}", "k": k}})).raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(make(k) for k in range(count)))
        create_s = time.perf_counter() - t0

        async def timed(params: dict[str, Any]) -> dict[str, Any]:
            times, body = [], {}
            for _ in range(reps):
                t = time.perf_counter()
                r = await http.get("/ui/api/sessions", params=params)
                times.append(time.perf_counter() - t)
                body = r.json()
            return {"median_ms": round(1000 * statistics.median(times), 2), "max_ms": round(1000 * max(times), 2),
                    "rows": len(body["sessions"]), "matched": body["matched"], "total": body["total"]}

        return {"sessions": count, "create_s": round(create_s, 2),
                "page_1": await timed({"limit": 50}),
                "filtered_meta_task_t3": await timed({"meta": "task=t3", "limit": 50}),
                "last_page": await timed({"offset": count - 50, "limit": 50})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", type=int, default=24_000, help="prompt size (~4 tokens a word here)")
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tok = str(cached_tokenizer_dir("qwen3"))
    with sim_engine("sglang", tok) as engine, server([f"sglang={engine}"], tok) as url:
        out = {"long_line": asyncio.run(long_line(url, args.words))}
    with sim_engine("sglang", tok) as engine, server([f"sglang={engine}"], tok) as url:
        out["session_list"] = asyncio.run(many_sessions(url, args.sessions, args.reps))
    out["machine"] = {"cpus": os.cpu_count(), "chromium": CHROMIUM}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
