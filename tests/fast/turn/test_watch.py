"""A turn the client does not stream, watched by a viewer (`GET /sessions/{sid}/live`):
the watcher gets the engine's tokens as they are sampled, while the client's answer and
the committed trajectory are an unwatched turn's, and a lie only in the engine's stream
stops what the watcher sees without failing the turn."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ..stack import Stack, live_stack

U1 = [{"role": "user", "content": "The tests fail after the config change. Fix it."}]
BODY = {"messages": U1, "max_tokens": 60}


async def _watched_turn(st: Stack, sid: str) -> tuple[Any, list[dict[str, Any]]]:
    """One non-streamed turn while a watcher reads the live events: (the answer, the events)."""
    events: list[dict[str, Any]] = []
    async with st.http.stream("GET", f"/sessions/{sid}/live") as live:
        lines = live.aiter_lines()

        async def read() -> None:
            async for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["event"] == "end":
                        return

        reader = asyncio.create_task(read())
        while not events:  # subscribed (hello) before the turn starts
            await asyncio.sleep(0.01)
        answer = await st.chat(sid, BODY)
        await asyncio.wait_for(reader, 10)
    return answer, events


async def test_a_watched_non_streamed_turn_shows_its_tokens_and_commits_as_an_unwatched_one(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=5, script=[{"content": "step " * 40}] * 2) as st:
        ref_sid = await st.session()
        ref = await st.chat(ref_sid, BODY)
        sid = await st.session()
        answer, events = await _watched_turn(st, sid)
        assert answer.status_code == 200 and answer.json()["choices"] == ref.json()["choices"]
        line, ref_line = (await st.trajectory(sid))["branches"][0], (await st.trajectory(ref_sid))["branches"][0]
        for key in ("token_ids", "loss_mask", "logprobs"):
            assert line[key] == ref_line[key], key
        kinds = [e["event"] for e in events]
        assert kinds[:2] == ["hello", "begin"] and kinds[-1] == "end" and events[-1]["committed"] is True
        assert events[1]["streams"] is False
        shown = [i for e in events if e["event"] == "tokens" for i in e["ids"]]
        (turn,) = line["turns"]
        assert kinds.count("tokens") > 1  # as sampled, not one lump at the end
        assert shown == line["token_ids"][turn["output_start"]:turn["output_end"]]


async def test_a_lie_only_in_the_engine_stream_stops_the_watchers_view_not_the_turn(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, latency_ms=2, script=[{"content": "step " * 40}]) as st:
        sid = await st.session()
        await st.fault("stream_oov_id")  # the frames lie; the final answer is clean
        answer, events = await _watched_turn(st, sid)
        assert answer.status_code == 200, answer.text  # as an unwatched, non-streamed turn
        kinds = [e["event"] for e in events]
        assert "unshown" in kinds and "tokens" not in kinds, kinds
        assert events[-1] == {"event": "end", "committed": True}
