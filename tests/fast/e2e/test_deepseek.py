"""DeepSeek: the HTTP e2e through the real `openai` client and sim engines on
both protocols for DeepSeek V3.2 (offline tokenizer with its real template, and the real
DeepSeek tokenizer with the V3.2 template), detected from the template alone and served
by our prefill-aware `DeepSeekCodec`: a multi-turn tool episode, every turn token-exact
against engine I/O."""

from __future__ import annotations

from pathlib import Path

import pytest

from session_server.ops.demo import run_agent
from tests.fast.real_tokenizers import real_tokenizer_dir
from tests.fast.trajectory.renderer_families import BY_NAME, build
from trajectory.codec import DeepSeekCodec, load_codec

from ..stack import live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

PROTOCOLS = ["sglang", "vllm"]
NAMES = ["deepseek-v3.2", "deepseek-v3.2-real"]


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"root": tmp_path_factory.mktemp("deepseek-e2e")}


def _dir(dirs: dict[str, Path], name: str) -> Path:
    if name not in dirs:
        dest = dirs["root"] / "my-finetune" / name.replace(".", "_")
        dirs[name] = real_tokenizer_dir(name, dest) if name.endswith("-real") else build(BY_NAME[name], dest)
    return dirs[name]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", NAMES)
async def test_e2e_deepseek_v32_tool_episode(ds_dirs: dict[str, Path], name: str, protocol: str) -> None:
    tag = f"{name}/{protocol}"
    path = _dir(ds_dirs, name)
    assert isinstance(load_codec(str(path)), DeepSeekCodec), tag  # detected, not named
    async with live_stack(path, protocol) as st:
        sid = await st.session()
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert episode["tool_calls"], f"{tag}: the scripted agent calls tools"
    assert episode["finish_reason"] == "stop", tag
    (branch,) = traj["branches"]  # every turn appended to one line (APPEND keeps the prefill)
    assert len(branch["turns"]) >= 2, tag
    assert_trajectory_matches_engine(branch, log, tag)
    assert all(t["extra"]["parse_status"] == "ok" for t in branch["turns"]), tag
    # thinking off: the prompt prefilled `<think></think>`, a re-render shows `</think>`;
    # kept as the engine saw it and recorded on every later turn
    assert all("history_rewrite" in t["extra"] for t in branch["turns"][1:]), tag
