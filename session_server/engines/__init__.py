"""Engine adapters behind one seam (`EngineAdapter`), and `make_adapter` for a URL spec."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from session_server.engines.admission_check import detect_protocol, parse_engine_spec
from session_server.engines.base import (
    EngineAdapter,
    EngineCapabilities,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from session_server.engines.http import ConnectionLimits, raise_nofile_limit, retry_transient
from session_server.engines.sglang import SGLangAdapter
from session_server.engines.sglang_replies import parse_sglang_generate, parse_sglang_stream
from session_server.engines.vllm import VLLMAdapter
from session_server.engines.vllm_replies import (
    parse_vllm_completions,
    parse_vllm_generate,
    parse_vllm_logprob_content,
)

__all__ = [
    "ConnectionLimits",
    "EngineAdapter",
    "EngineCapabilities",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "SGLangAdapter",
    "SamplingParams",
    "VLLMAdapter",
    "detect_protocol",
    "make_adapter",
    "parse_engine_spec",
    "parse_sglang_generate",
    "parse_sglang_stream",
    "parse_vllm_completions",
    "parse_vllm_generate",
    "parse_vllm_logprob_content",
    "raise_nofile_limit",
    "retry_transient",
]


async def make_adapter(spec: str, *, sglang_incremental: Collection[str] = (),
                       **kwargs: Any) -> SGLangAdapter | VLLMAdapter:
    """An adapter for `sglang=URL`, `vllm=URL` (forced) or a bare URL (protocol detected).
    `sglang_incremental`: the base URLs of SGLang servers started with
    `--incremental-streaming-output` (`*`: every one), whose stream frames are deltas."""
    protocol, url = parse_engine_spec(spec)
    if protocol is None:
        protocol = await detect_protocol(url)
    if protocol == "sglang":
        deltas = "*" in sglang_incremental or url in {u.rstrip("/") for u in sglang_incremental}
        return SGLangAdapter(url, incremental_stream=deltas, **kwargs)
    return VLLMAdapter(url, **kwargs)
