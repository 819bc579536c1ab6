"""Every pipeline phase named in `metrics.PHASES` is timed once per turn."""

from __future__ import annotations

from pathlib import Path

from session_server.metrics import PHASES

from ..stack import CHAT, live_stack, metric_value


async def test_each_phase_is_observed_once_per_turn(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        for stream in (False, True):  # a JSON and an SSE response
            r = await st.chat(await st.session(), {**CHAT, "stream": stream})
            assert r.status_code == 200, r.text
        text = (await st.http.get("/metrics")).text
        for phase in PHASES:
            assert metric_value(text, "tito_turn_phase_seconds_count", phase=phase) == 2, phase


def test_phase_values_are_frozen() -> None:
    """Each phase hands the next a frozen value: no phase mutates what an earlier one decided."""
    import dataclasses

    from session_server.turn.commit import Checked, Committed
    from session_server.turn.dispatch import Generated
    from session_server.turn.engine_request import EngineCall
    from session_server.turn.pipeline import TurnOutput
    from session_server.turn.prepare import Prepared, Prompt

    for cls in (Prepared, Prompt, EngineCall, Generated, Checked, Committed, TurnOutput):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls.__name__  # type: ignore[attr-defined]


def test_dialect_parses_and_responds_with_pure_functions() -> None:
    """The OpenAI dialect is the `Dialect` interface: body -> ChatRequest (bad input a 400),
    TurnOutput -> one JSON body or SSE frames ending in [DONE]."""
    import orjson
    import pytest

    from session_server.api.dialects import OPENAI_CHAT, Dialect
    from session_server.errors import BadRequest
    from session_server.turn.pipeline import TurnOutput

    dialect: Dialect = OPENAI_CHAT
    req = dialect.parse(orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "m"}))
    assert req.model == "m" and req.messages[0]["content"] == "hi"
    with pytest.raises(BadRequest):
        dialect.parse(b"{not json")
    out = TurnOutput(request_id="r", message={"role": "assistant", "content": "ok"}, finish_reason="stop",
                     prompt_tokens=3, completion_tokens=1, cached_tokens=0, sampled_ids=[1], logprobs=[-0.5],
                     top_logprobs=None, turn_index=0, branch_id=0)
    body = orjson.loads(dialect.body(out, req, tokenizer=None))
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"][0]["message"] == out.message
    frames = dialect.stream(out, req, tokenizer=None)
    assert frames[-1] == b"data: [DONE]\n\n" and b'"content":"ok"' in frames[1]
