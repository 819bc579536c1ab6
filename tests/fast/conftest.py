"""Shared fast-test fixtures: offline tokenizers of every chat-template family.

Built once per test session (byte-level BPE trained in-process, no network) and
loaded back through the real path, `AutoTokenizer.from_pretrained(str(path))`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from session_server.sim.tokenizers import FAMILIES, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> directory of its saved offline tokenizer."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: build_tokenizer(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def load_tokenizer(tokenizer_dirs: dict[str, Path]) -> Callable[[str], Any]:
    """`load_tokenizer(family)` -> a transformers tokenizer (cached per family)."""
    from transformers import AutoTokenizer

    cache: dict[str, Any] = {}

    def _load(family: str) -> Any:
        if family not in cache:
            cache[family] = AutoTokenizer.from_pretrained(str(tokenizer_dirs[family]))
        return cache[family]

    return _load


@pytest.fixture(scope="session")
def load_renderer_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """`load_renderer_tokenizer(name)` -> the offline tokenizer of a renderers family
    (tests/fast/trajectory/renderer_families.py), built once, loaded from disk."""
    from transformers import AutoTokenizer

    from tests.fast.trajectory.renderer_families import BY_NAME, build

    root = tmp_path_factory.mktemp("renderer-tokenizers")
    cache: dict[str, Any] = {}

    def _load(name: str) -> Any:
        if name not in cache:
            path = build(BY_NAME[name], root / name.replace(".", "_"))
            cache[name] = AutoTokenizer.from_pretrained(str(path))
        return cache[name]

    return _load


@pytest.fixture
def qwen3_dir(tokenizer_dirs: dict[str, Path]) -> Path:
    return tokenizer_dirs["qwen3"]


@pytest.fixture(autouse=True)
def _journal_failures_never_end_the_test_process() -> Iterator[None]:
    """`serve` run in-process (its CLI, with uvicorn faked) arms "a journal that does not
    replay ends the process with status 65"; a later test that breaks a journal on
    purpose would then end pytest itself. Each test starts with it off."""
    from session_server import durability

    armed = durability.EXIT_ON_FATAL[0]
    durability.EXIT_ON_FATAL[0] = False
    yield
    durability.EXIT_ON_FATAL[0] = armed
