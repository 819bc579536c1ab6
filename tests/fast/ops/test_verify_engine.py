"""`verify-template --engine URL` drives an engine through our server and
checks every turn is token-exact with the wire (session_server/ops/verify_engine.py), here
against the simulated engines on both protocols, and fails on a token dropped between
the engine and the session."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from session_server.engines.sglang import SGLangAdapter
from session_server.ops import cli
from session_server.sim import running_sim
from session_server.sim.tokenizers import cached_tokenizer_dir


async def _run(protocol: str, *extra: str) -> int:
    tok = str(cached_tokenizer_dir("qwen3"))
    async with running_sim(protocol, tok, seed=5) as url:
        return await asyncio.to_thread(cli.main, ["verify-template", "--tokenizer", tok, "--engine", url,
                                                  "--protocol", protocol, "--thinking", "on", *extra])


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_engine_turns_token_exact_on_sim(protocol: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = await _run(protocol, "--json")
    report = json.loads(capsys.readouterr().out)
    engine = report["engine"]
    assert rc == 0 and report["ok"] is True and engine["ok"] is True, engine
    steps = engine["steps"]
    assert {s["scenario"] for s in steps} == {"user", "tool_result", "parallel_tool_calls"}
    assert len(steps) == 6 and all(s["checks"]["sampled"] and s["checks"]["prompt"] for s in steps)
    assert all("render0" in s["checks"] for s in steps if s["turn"] == 0)
    assert all("prefix" in s["checks"] for s in steps if s["turn"] == 1)
    assert all(s["sampled"] > 5 for s in steps)  # the scripted agent answers (reasoning, calls)


async def test_engine_dropped_token_is_a_hard_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine sampled N ids; the session commits N-1 (its first token lost on our side): the
    stored sampled ids differ from the wire, the next prompt no longer extends the
    engine's own prompt + output; exit 1 naming the checks."""
    real = SGLangAdapter.generate

    async def drop_last(self: Any, request: Any) -> Any:
        res = await real(self, request)
        if len(res.output_ids) < 2:
            return res
        return dataclasses.replace(res, output_ids=list(res.output_ids)[1:], logprobs=list(res.logprobs)[1:],
                                   completion_tokens=len(res.output_ids) - 1, output_ids_echo=None,
                                   top_logprobs=None)

    monkeypatch.setattr(SGLangAdapter, "generate", drop_last)
    rc = await _run("sglang")
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "[FAIL] user[0] thinking=on" in out and "sampled=FAIL" in out
    assert "engine's sampled ids != stored sampled ids" in out and out.rstrip().endswith("engine: FAILED")


async def test_engine_unreachable_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    tok = str(cached_tokenizer_dir("qwen3"))
    rc = await asyncio.to_thread(cli.main, ["verify-template", "--tokenizer", tok, "--engine",
                                            "sglang=http://127.0.0.1:9", "--thinking", "off"])
    out = capsys.readouterr().out
    assert rc == 1 and "engine: FAILED" in out and "Cannot connect to host 127.0.0.1:9" in out
