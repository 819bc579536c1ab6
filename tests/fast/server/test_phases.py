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


def test_9_phase_values_are_frozen() -> None:
    """Each phase hands the next a frozen value: no phase mutates what an earlier one decided."""
    import dataclasses

    from session_server.commit import Checked, Committed
    from session_server.dispatch import Generated
    from session_server.engine_request import EngineCall
    from session_server.prepare import Prepared, Rendered
    from session_server.turns import TurnOutput

    for cls in (Prepared, Rendered, EngineCall, Generated, Checked, Committed, TurnOutput):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__  # type: ignore[attr-defined]
