"""Gemma 4: the HTTP e2e (real `openai` client through the demo agent, sim engines
on both protocols) served by our Gemma4Codec, detected from the template of a renamed
local copy. A multi-turn tool episode with reasoning; every turn token-exact with the
engine's input and output.

The sim resumes the model's turn after tool results (`SimModel.resume_ids`): Gemma 4 adds
no generation prompt there, the model continues its own turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from session_server.ops.demo import run_agent
from tests.fast.trajectory.renderer_families import BY_NAME, build
from trajectory.codec import Gemma4Codec, load_codec

from ..stack import live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

PROTOCOLS = ["sglang", "vllm"]
# (session options, whether a rewrite is recorded): thinking off (the template's default)
# re-renders the prompt's empty thought channel away, so APPEND keeps it and records the
# rewrite per turn; thinking on, the tool loop is append-only: even TEMPLATE never forks
MODES = {
    "default-append": ({"history_policy": "append"}, True),
    "thinking-template": ({"history_policy": "template", "chat_template_kwargs": {"enable_thinking": True}}, False),
}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(BY_NAME["gemma-4"], tmp_path_factory.mktemp("gemma-e2e") / "my-finetune")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", sorted(MODES))
async def test_a_gemma4_tool_episode_is_token_exact_over_http(gemma_dir: Path, protocol: str, mode: str) -> None:
    tag = f"gemma-4/{mode}/{protocol}"
    options, rewrites = MODES[mode]
    assert isinstance(load_codec(str(gemma_dir)), Gemma4Codec), tag  # detected, not named
    async with live_stack(gemma_dir, protocol) as st:
        sid = await st.session(**options)
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert episode["tool_calls"], f"{tag}: the scripted agent calls tools"
    assert episode["finish_reason"] == "stop", tag
    assert episode["messages"][-1]["content"].startswith("Done:"), f"{tag}: the sim resumed the turn"
    called = [m for m in episode["messages"] if m.get("tool_calls")]
    assert called and all(m.get("reasoning_content") for m in called), f"{tag}: reasoning parsed"
    (branch,) = traj["branches"]  # every turn appended to one line
    turns = branch["turns"]
    assert len(turns) >= 2, tag
    assert_trajectory_matches_engine(branch, log, tag)
    assert all(t["extra"]["parse_status"] == "ok" for t in turns), tag
    recorded = [bool(t["extra"].get("history_rewrite")) for t in turns[1:]]
    assert all(recorded) if rewrites else not any(recorded), f"{tag}: {recorded}"
    # after a call the engine's next prompt ends with the tool results: the model
    # resumes its own turn, no new `<|turn>model` is opened
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma_dir))
    served = [r for r in log if r["status"] == 200]
    assert all(tok.convert_ids_to_tokens(r["input_ids"][-1]) == "<tool_response|>" for r in served[1:]), tag
    assert all(tok.convert_ids_to_tokens(r["output_ids"][-1]) == "<|tool_response>" for r in served[:-1]), tag
