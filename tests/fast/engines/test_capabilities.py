"""The engine seam is declared, not discovered: every adapter has the required members,
each capability it declares has the methods of its protocol, and the engine facts the
control plane relies on (pause-mode names, bulk aborts) are answered by the adapter."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from session_server.engines import SGLangAdapter, VLLMAdapter
from session_server.engines.base import (
    DPSizeReporting,
    EngineAdapter,
    EngineCapabilities,
    LoadReporting,
    ModelNaming,
    Streaming,
    VersionPushing,
)

_PROTOCOL_OF = {
    "streams": Streaming,
    "reports_load": LoadReporting,
    "reports_dp_size": DPSizeReporting,
    "names_model": ModelNaming,
    "pushes_weight_version": VersionPushing,
}


def _own_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if inspect.isfunction(v)}


# capabilities that are a fact about the engine's replies, not methods of a protocol
_REPLY_FACTS = {"support_logprobs", "incremental_stream"}  # what a reply looks like, not a method


def test_every_capability_flag_names_a_protocol() -> None:
    assert set(EngineCapabilities.__dataclass_fields__) - _REPLY_FACTS == set(_PROTOCOL_OF)


def test_each_adapter_says_how_its_top_logprobs_show_the_sampling_support() -> None:
    # vLLM with --logprobs-mode processed_logprobs masks at -inf; SGLang's are post-temperature, untruncated
    assert VLLMAdapter.capabilities.support_logprobs == "processed"
    assert SGLangAdapter.capabilities.support_logprobs == "post_temperature"


@pytest.mark.parametrize("cls", [SGLangAdapter, VLLMAdapter])
def test_an_adapter_has_every_required_member_and_the_methods_it_declares(cls: Any) -> None:
    adapter = cls("http://127.0.0.1:9")
    assert isinstance(adapter, EngineAdapter)
    for flag, proto in _PROTOCOL_OF.items():
        declared = getattr(adapter.capabilities, flag)
        has = all(callable(getattr(cls, m, None)) for m in _own_methods(proto))
        assert declared == has, f"{cls.__name__}: {flag} declared {declared}, methods present {has}"


def test_vllm_does_not_declare_a_dp_size_and_sglang_does() -> None:
    assert SGLangAdapter.capabilities.reports_dp_size and not VLLMAdapter.capabilities.reports_dp_size


def test_each_adapter_names_the_plane_pause_modes_in_its_engine_words() -> None:
    sglang, vllm = SGLangAdapter("http://127.0.0.1:9"), VLLMAdapter("http://127.0.0.1:9")
    # SGLang freezes in place for keep, and has no drain mode: wait is frozen in place too
    assert [sglang.pause_mode(m) for m in ("abort", "keep", "wait")] == ["abort", "in_place", "in_place"]
    assert [vllm.pause_mode(m) for m in ("abort", "keep", "wait")] == ["abort", "keep", "wait"]


@pytest.mark.parametrize("cls", [SGLangAdapter, VLLMAdapter])
async def test_a_bulk_abort_of_no_requests_sends_nothing(cls: Any) -> None:
    """vLLM's empty `/abort_requests` list aborts everything: an empty bulk abort must
    reach no engine (the URL is closed, so any call would fail)."""
    adapter = cls("http://127.0.0.1:9", retries=0)
    try:
        await adapter.abort_requests([])
    finally:
        await adapter.aclose()
