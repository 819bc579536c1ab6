"""Routing replay needs the model's routed-experts shape (SGLang sends each row flat):
a server that cannot know it refuses the session at creation, naming the flags that
supply it, instead of doing every turn's engine work and answering 502; a server
whose engine names a model whose config.json it can read learns the shape there."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from session_server.app import AppConfig
from session_server.client import AsyncSessionClient
from session_server.context import Settings
from session_server.model_config import read_config_routed_shape
from session_server.ops.harness import running_server
from session_server.sim import running_sim
from session_server.sim.routed import RoutedSpec, line_rows

from ..stack import CHAT, Stack, live_stack

MOE = RoutedSpec(layers=3, topk=2, num_experts=8)  # not the simulator's default (4, 2, 16)


@pytest.fixture
def moe_model_dir(qwen3_dir: Path, tmp_path: Path) -> Path:
    """A model directory as an engine serves it: the tokenizer beside a MoE config.json."""
    d = tmp_path / "moe-model"
    shutil.copytree(qwen3_dir, d)
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": MOE.layers,
        "num_experts_per_tok": MOE.topk, "num_experts": MOE.num_experts}))
    return d


@contextlib.asynccontextmanager
async def engine_serving(model_dir: Path, tokenizer_dir: Path, protocol: str = "sglang",
                         settings: Settings | None = None) -> AsyncIterator[Stack]:
    """A simulated engine serving `model_dir` behind a server whose tokenizer is
    `tokenizer_dir` (no MoE config there: the shape can only come from the engine)."""
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(running_sim(protocol, str(model_dir), return_routed_experts=True))
        config = AppConfig(tokenizer=str(tokenizer_dir), engines=[f"{protocol}={url}"],
                           settings=settings or Settings())
        server = await stack.enter_async_context(running_server(config))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=server, timeout=60))
        yield Stack(server, [url], http)


async def test_routing_replay_without_a_known_shape_is_refused_at_creation_naming_the_flags(
        qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        r = await st.http.post("/sessions", json={"routing_replay": True})
        plain = await st.http.post("/sessions", json={})
        log = await st.engine_log()
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for flag in ("--routed-experts-layers", "--routed-experts-topk", "TITO_ROUTED_EXPERTS_TOPK"):
        assert flag in message
    assert plain.status_code == 201  # only routing replay needs the shape
    assert log == []  # refused before any engine work


async def test_the_server_wide_routing_replay_default_is_refused_the_same_way(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, settings=Settings(routing_replay=True)) as st:
        r = await st.http.post("/sessions", json={})
        off = await st.http.post("/sessions", json={"routing_replay": False})
    assert r.status_code == 400 and "--routed-experts-topk" in r.json()["error"]["message"]
    assert off.status_code == 201


async def test_a_vllm_pool_needs_no_shape_its_payload_carries_it(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "vllm", return_routed_experts=True) as st:
        sid = await st.session(routing_replay=True)
        r = await st.chat(sid)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_the_shape_is_learned_from_the_engines_model_config_and_the_turn_commits_its_rows(
        moe_model_dir: Path, qwen3_dir: Path, protocol: str) -> None:
    async with engine_serving(moe_model_dir, qwen3_dir, protocol) as st:
        sid = await st.session(routing_replay=True)
        r = await st.chat(sid, CHAT)
        assert r.status_code == 200, r.text
        (sample,) = await AsyncSessionClient(st.url).samples(sid, format="json")
    rows = sample.routed_experts
    assert rows is not None and rows.shape == (len(sample) - 1, MOE.layers, MOE.topk)
    last_out = sample.turn_boundaries[-1][2]
    np.testing.assert_array_equal(rows[: last_out - 1], line_rows(sample.token_ids, MOE)[: last_out - 1])


async def test_a_setting_overrides_the_learned_shape(moe_model_dir: Path, qwen3_dir: Path) -> None:
    """The settings stay the operator's word: a topk other than the model's is a 502
    naming the setting (the engine's rows are checked against it), not silently mixed."""
    async with engine_serving(moe_model_dir, qwen3_dir, settings=Settings(routed_experts_topk=3)) as st:
        sid = await st.session(routing_replay=True)
        r = await st.chat(sid, CHAT)
    assert r.status_code == 502 and "routed_experts_topk" in r.json()["error"]["message"]


def test_the_config_shape_is_read_where_sglang_reads_it() -> None:
    """`hf_text_config`: the `text_config` of a multimodal model, else the top level;
    a dense model has no `num_experts_per_tok` and no shape."""
    assert read_config_routed_shape({"num_hidden_layers": 48, "num_experts_per_tok": 8, "num_experts": 128}) == (
        48, 8, 128)
    assert read_config_routed_shape({"num_hidden_layers": 61, "num_experts_per_tok": 8,
                                     "n_routed_experts": 256}) == (61, 8, 256)
    assert read_config_routed_shape({"num_hidden_layers": 2, "text_config": {
        "num_hidden_layers": 40, "num_experts_per_tok": 4}}) == (40, 4, None)
    assert read_config_routed_shape({"num_hidden_layers": 28, "vocab_size": 151936}) is None
