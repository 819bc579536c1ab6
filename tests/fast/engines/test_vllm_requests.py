"""What the vLLM adapter sends, judged by what a vLLM 0.32 (simulated as captured) answers."""

from __future__ import annotations

import pytest

from session_server.engines import GenerateRequest, VLLMAdapter
from session_server.engines.base import GenerateResult, streaming
from session_server.engines.vllm import engine_request_ids
from session_server.sim import running_sim

PROMPT = [1, 2, 3, 4, 5]


async def _streamed(adapter: VLLMAdapter, request: GenerateRequest) -> GenerateResult:
    streamer = streaming(adapter)
    assert streamer is not None
    final = None
    async for item in streamer.generate_stream(request):
        if isinstance(item, GenerateResult):
            final = item
    assert final is not None
    return final


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
async def test_a_streamed_request_asks_for_usage_and_a_plain_one_does_not(endpoint: str) -> None:
    """0.32 streams no usage frame unless asked (`stream_options.include_usage`), and its
    completions endpoint refuses `stream_options` on a request that does not stream: the
    streamed turn knows its prompt tokens, the plain one is answered at all."""
    async with running_sim("vllm", "toy") as url:
        adapter = VLLMAdapter(url, model="m", endpoint=endpoint)
        try:
            streamed = await _streamed(adapter, GenerateRequest("a" * 32, PROMPT, 8))
            plain = await adapter.generate(GenerateRequest("b" * 32, PROMPT, 8))
        finally:
            await adapter.aclose()
    assert streamed.prompt_tokens == len(PROMPT)
    assert plain.prompt_tokens == len(PROMPT) and plain.output_ids


def test_aborts_name_every_form_of_an_id_vllm_knows() -> None:
    """vLLM aborts by its own ids (`generate-tokens-ID`, `cmpl-ID`); a bare id aborts nothing."""
    assert engine_request_ids(["abc"]) == ["abc", "cmpl-abc", "generate-tokens-abc"]
    assert engine_request_ids([]) == []
