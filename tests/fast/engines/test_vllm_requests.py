"""What the vLLM adapter sends, against the facts captured from vLLM 0.32."""

from __future__ import annotations

import json

from session_server.engines import GenerateRequest, VLLMAdapter
from session_server.engines.vllm import engine_request_ids


async def test_a_streamed_token_in_generate_asks_for_usage() -> None:
    """0.32 streams no usage frame on `/inference/v1/generate` unless asked."""
    adapter = VLLMAdapter("http://127.0.0.1:9", model="m", endpoint="generate")
    try:
        path, body, _ = await adapter._request(GenerateRequest("a" * 32, [1, 2, 3], 8), stream=True)
        sent = json.loads(body)
        _, plain, _ = await adapter._request(GenerateRequest("b" * 32, [1, 2, 3], 8), stream=False)
    finally:
        await adapter.aclose()
    assert path == "/inference/v1/generate"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert "stream_options" not in json.loads(plain)


def test_aborts_name_every_form_of_an_id_vllm_knows() -> None:
    """vLLM aborts by its own ids (`generate-tokens-ID`, `cmpl-ID`); a bare id aborts nothing."""
    assert engine_request_ids(["abc"]) == ["abc", "cmpl-abc", "generate-tokens-abc"]
    assert engine_request_ids([]) == []
