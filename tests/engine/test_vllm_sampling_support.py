"""Sampling support against the real vLLM, started with `--logprobs-mode processed_logprobs`
(an engine argument, not a request field: config/model.py `logprobs_mode`, 0.32).

A session with `sampling_support` asks k = 8 top logprobs; vLLM's processed logprobs
read -inf (sent as -9999.0) for every token its top-k = 4 masked, so the support the
server stores for each sampled token is the returned ids above that floor: it holds the
sampled token and top_k ids (more only where bf16 logits tie with the 4th, as vLLM's
top-k keeps ties)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from session_server.engines.vllm_replies import parse_vllm_generate
from trajectory.sample_formats import load_samples_npz
from trajectory.support import PROCESSED_FLOOR

from .conftest import serve_process
from .helpers import new_session
from .recorder import recording_proxy
from .vllm_engine import ENGINE_FLAGS, VLLMServer, vllm_server

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

TOP_K, K = 4, 8


@pytest.fixture(scope="module")
def processed_vllm(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """Its own vLLM: the shared one runs on the default raw logprobs."""
    flags = (*ENGINE_FLAGS, "--logprobs-mode", "processed_logprobs")
    with vllm_server(qwen3_dir, tmp_path_factory.mktemp("vllm-processed"), extra=flags) as server:
        yield server


async def test_each_tokens_support_holds_it_and_top_k_ids(
    processed_vllm: VLLMServer, qwen3_dir: Path, tmp_path: Path
) -> None:
    async with recording_proxy(processed_vllm.url) as rec, \
            serve_process(rec.url, qwen3_dir, tmp_path / "serve.log") as url, \
            httpx.AsyncClient(base_url=url, timeout=600) as http:
        sid = await new_session(http, sampling_support=K, sampling={"top_k": TOP_K, "temperature": 1.0})
        r = await http.post(f"/sessions/{sid}/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 24})
        assert r.status_code == 200, r.text
        npz = await http.get(f"/sessions/{sid}/samples", params={"format": "npz"})
        (sample,) = load_samples_npz(npz.content)
        # the turn's one generation (serve may probe the engine at start), asking k top logprobs
        (gen,) = [g for g in rec.generations() if (g.request.get("sampling_params") or {}).get("logprobs") == K]
    sup = sample.sampling_support
    assert sup is not None
    sampled = [i for i in range(len(sample)) if sample.loss_mask[i]]
    assert len(sampled) > 0
    rows = [sup.row(i).tolist() for i in sampled]
    for i, row in zip(sampled, rows, strict=True):
        assert int(sample.token_ids[i]) in row
        assert TOP_K <= len(row) < K
    assert sum(len(r) == TOP_K for r in rows) >= len(rows) // 2  # ties at the 4th are the exception
    # the wire: what vLLM masked reads its -9999.0 floor, what it kept is the stored support
    reply = parse_vllm_generate(gen.body, request_id=str(gen.request.get("request_id", "")))
    assert reply.top_logprobs is not None
    for tops, row in zip(reply.top_logprobs, rows, strict=True):
        kept = {int(t) for t, lp in tops if lp > PROCESSED_FLOOR}
        assert kept == set(row) and any(lp == PROCESSED_FLOOR for _, lp in tops)
