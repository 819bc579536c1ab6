"""The trajectory viewer through `session-server cluster`: the pages, their scripts, the
session list (every instance's sessions, whichever instance the proxy picked), a
session's token texts and its live stream, all through HAProxy. Skipped only when
`haproxy` is absent."""

from __future__ import annotations

from pathlib import Path

import httpx

from session_server.sim import running_sim

from .test_cluster import needs_haproxy, running_cluster


@needs_haproxy
async def test_viewer_pages_list_tokens_and_live_through_the_proxy_cover_every_instance(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=3) as engine, \
            running_cluster(qwen3, engine, 3, tmp_path, "--no-restart", "--no-journal") as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=60) as http:
        sids = [(await http.post("/sessions", json={"metadata": {"k": k}})).json()["session_id"] for k in range(24)]
        assert {sid.split(".")[0] for sid in sids} == set(cl.workers)  # every instance holds some
        for path in ("/ui", f"/ui/sessions/{sids[0]}", "/ui/control", "/ui/static/tokens.js", "/ui/static/list.js"):
            r = await http.get(path)
            assert r.status_code == 200, (path, r.status_code)
        # the list, asked many times (the proxy picks a different instance), always pages all 24 once
        for _ in range(4):
            seen: list[str] = []
            for offset in range(0, 30, 7):
                body = (await http.get("/ui/api/sessions", params={"offset": offset, "limit": 7})).json()
                assert body["total"] == 24 and body["matched"] == 24 and body["missing"] == {}
                assert sorted(body["instances"]) == sorted(cl.workers)
                seen += [row["session_id"] for row in body["sessions"]]
            assert sorted(seen) == sorted(sids)
        body = (await http.get("/ui/api/sessions", params={"meta": "k=5"})).json()
        assert [row["session_id"] for row in body["sessions"]] == [sids[5]]
        # one session's tokens and live stream reach its own instance
        for sid in sids[:3]:
            r = await http.post(f"/sessions/{sid}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "hi 😀"}], "max_tokens": 8})
            assert r.status_code == 200, r.text
            texts = (await http.get(f"/sessions/{sid}/tokens", params={"branch": 0})).json()["texts"]
            assert "😀" in "".join(texts)
            async with http.stream("GET", f"/sessions/{sid}/live") as live:
                assert live.status_code == 200
                first = await anext(live.aiter_lines())
                assert first.startswith("data: ") and '"hello"' in first
