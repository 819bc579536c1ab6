"""Control-plane test fixtures: the qwen3 simulated model, prompts and a spy adapter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from session_server.engines import GenerateRequest, GenerateResult, SGLangAdapter, VLLMAdapter
from session_server.sim import SimModel, load_sim_model


@pytest.fixture(scope="session")
def qwen3_model(tokenizer_dirs: dict[str, Path]) -> SimModel:
    return load_sim_model(str(tokenizer_dirs["qwen3"]))


@pytest.fixture(scope="session")
def make_prompt(load_tokenizer: Callable[[str], Any]) -> Callable[[str], list[int]]:
    tok = load_tokenizer("qwen3")

    def _prompt(text: str) -> list[int]:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tok.encode(rendered, add_special_tokens=False))

    return _prompt


def make_adapter(protocol: str, url: str) -> SGLangAdapter | VLLMAdapter:
    return SGLangAdapter(url, retries=0) if protocol == "sglang" else VLLMAdapter(url, retries=0)


class Spy:
    """Delegates to a real adapter and records every request it is given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.protocol = inner.protocol
        self.base_url = inner.base_url
        self.requests: list[GenerateRequest] = []
        self.results: list[GenerateResult] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        result = await self.inner.generate(request)
        self.results.append(result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
