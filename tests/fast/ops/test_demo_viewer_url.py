"""`session-server demo` prints its session's page in the trajectory viewer, and that
page is served while the demo runs."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import orjson
import pytest

from session_server.ops import demo


async def test_demo_prints_its_sessions_viewer_url_that_serves_the_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    served: list[int] = []
    real_agent = demo.run_agent

    async def agent_then_open_page(base_url: str, *, max_turns: int) -> dict[str, object]:
        out = await real_agent(base_url, max_turns=max_turns)
        url = re.search(r"viewer: (\S+)", capsys.readouterr().out)
        assert url is not None
        print(url.group(0))  # put back what the read took
        async with httpx.AsyncClient() as c:
            served.append((await c.get(url.group(1))).status_code)
        return out

    monkeypatch.setattr(demo, "run_agent", agent_then_open_page)
    assert await demo.run_demo(out_dir=str(tmp_path), turns=2) == 0
    printed = capsys.readouterr().out
    sid = orjson.loads((tmp_path / "trajectory.json").read_bytes())
    urls = re.findall(r"http://127\.0\.0\.1:\d+/ui/sessions/(\S+)", printed)
    assert urls and set(urls) == {sid["metadata"]["session_id"]}
    assert served == [200]
