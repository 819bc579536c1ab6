"""`verify-template --engine` against a real SGLang or vLLM engine: skipped
unless one is named (the same variables as test_real_engine.py).

    SESSION_SERVER_GPU_ENGINE=sglang=http://gpu-node:30000 \\
    SESSION_SERVER_GPU_TOKENIZER=Qwen/Qwen3-8B \\
    python -m pytest tests/gpu/test_verify_engine.py -q
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

ENGINE = os.environ.get("SESSION_SERVER_GPU_ENGINE")
TOKENIZER = os.environ.get("SESSION_SERVER_GPU_TOKENIZER")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (ENGINE and TOKENIZER), reason="set SESSION_SERVER_GPU_ENGINE and SESSION_SERVER_GPU_TOKENIZER"),
]


async def test_verify_template_engine_is_token_exact(capsys: pytest.CaptureFixture[str]) -> None:
    """Every probe turn: prompt sent == template render (turn 0) == stored prompt, the
    next prompt extends prompt + sampled, sampled ids == stored, the message parses back."""
    from session_server.ops import cli

    assert ENGINE and TOKENIZER
    rc = await asyncio.to_thread(cli.main, ["verify-template", "--tokenizer", TOKENIZER, "--engine", ENGINE, "--json"])
    report = json.loads(capsys.readouterr().out)
    engine = report["engine"]
    assert engine["ok"], json.dumps([s for s in engine["steps"] if not s["ok"]] or engine, indent=1)[:4000]
    assert all(s["sampled"] > 0 for s in engine["steps"])
    assert rc == (0 if report["ok"] else 1)
