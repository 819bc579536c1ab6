"""Fixtures of the real-engine suite: tiny real-architecture models, one vLLM per module,
`session-server serve` as a process in front of it, and a recording proxy between them.

Without a vLLM interpreter the suite skips on a developer's machine; in CI (`CI` set)
that is a failure: `.ci/run` installs vLLM, and a suite that silently skips proves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from session_server.ops.harness import free_port

from .recorder import Recorder, recording_proxy
from .vllm_engine import ENGINE_FLAGS, VLLMServer, build_tiny_qwen3, vllm_python, vllm_server

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if vllm_python() is not None:
        return
    if os.environ.get("CI"):
        raise pytest.UsageError("CI: no vLLM interpreter (.venv-vllm or TITO_VLLM_PYTHON): .ci/run installs it")
    skip = pytest.mark.skip(reason="vLLM CPU build not installed (see .ci/run, or set TITO_VLLM_PYTHON)")
    for item in items:
        if "tests/engine" in str(item.fspath):
            item.add_marker(skip)


# A developer iterating on the suite may point it at an engine already running
# (`TITO_VLLM_URL`, serving `TITO_VLLM_MODEL_DIR`, started with `ENGINE_FLAGS` and with
# `tests/engine/plugins` on its PYTHONPATH) instead of paying a start per module. CI never
# sets them.
RUNNING_URL = os.environ.get("TITO_VLLM_URL")
RUNNING_MODEL = os.environ.get("TITO_VLLM_MODEL_DIR")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense Qwen3 with the released vocabulary rows and the real tokenizer."""
    if RUNNING_URL and RUNNING_MODEL:
        return Path(RUNNING_MODEL)
    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="module")
def vllm(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One vLLM per test module (start-up is 60-90 s on 2 cores)."""
    if RUNNING_URL and RUNNING_MODEL:
        yield VLLMServer(url=RUNNING_URL, model=RUNNING_MODEL, log=Path(os.devnull), process=None)
        return
    with vllm_server(qwen3_dir, tmp_path_factory.mktemp("vllm-logs"), extra=ENGINE_FLAGS) as server:
        yield server



@dataclass
class Stack:
    """`session-server serve` (a process) -> recording proxy -> vLLM."""

    url: str  # the session server
    engine: VLLMServer
    rec: Recorder
    tokenizer_dir: Path
    log: Path

    def session_view(self, sid: str) -> dict:  # type: ignore[type-arg]
        return dict(httpx.get(f"{self.url}/sessions/{sid}", timeout=30).json())


def server_cmd() -> list[str]:
    script = Path(sys.executable).with_name("session-server")
    return [str(script)] if script.exists() else [sys.executable, "-m", "session_server.ops.cli"]


@contextlib.asynccontextmanager
async def serve_process(engine_url: str, tokenizer_dir: Path, log: Path, *args: str) -> AsyncIterator[str]:
    """`session-server serve` in front of `engine_url`, on a free port; always stopped."""
    port = free_port()
    cmd = [*server_cmd(), "serve", "--engine", f"vllm={engine_url}", "--tokenizer", str(tokenizer_dir),
           "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url + "/health")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"serve did not start:\n{log.read_text()[-3000:]}")
                await asyncio.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)


@pytest.fixture(scope="module")
async def stack(vllm: VLLMServer, qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    async with recording_proxy(vllm.url) as rec, serve_process(rec.url, qwen3_dir, log) as url:
        yield Stack(url=url, engine=vllm, rec=rec, tokenizer_dir=qwen3_dir, log=log)


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))
