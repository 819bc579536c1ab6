"""Every pipeline phase named in `metrics.PHASES` is timed once per turn (issue 9)."""

from __future__ import annotations

from pathlib import Path

from session_server.metrics import PHASES

from .conftest import CHAT, live_stack, metric_value


async def test_9_each_phase_is_observed_once_per_turn(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        for stream in (False, True):  # a JSON and an SSE response
            r = await st.chat(await st.session(), {**CHAT, "stream": stream})
            assert r.status_code == 200, r.text
        text = (await st.http.get("/metrics")).text
        for phase in PHASES:
            assert metric_value(text, "tito_turn_phase_seconds_count", phase=phase) == 2, phase
