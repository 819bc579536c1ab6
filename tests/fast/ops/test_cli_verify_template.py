"""`session-server verify-template` (text and --json, exit status)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from session_server.ops import cli


def _save_broken_qwen3(tokenizer_dirs: dict[str, Path], out: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dirs["qwen3"]))
    old = "'\\n<tool_response>\\n'"
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, "'\\n<tool_response n=' + loop.index0|string + '>\\n'")
    tok.save_pretrained(str(out))
    return out


def test_cli_passes_with_text_report(tokenizer_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["verify-template", "--tokenizer", str(tokenizer_dirs["llama3.1"])])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "family: llama3.1" in out and "append-only" in out and out.rstrip().endswith("OK")
    assert "engine" not in out  # --engine runs the live check: tests/fast/ops/test_verify_engine.py


def test_cli_json_with_forced_family(tokenizer_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["verify-template", "--tokenizer", str(tokenizer_dirs["glm4moe"]),
                   "--family", "glm4moe", "--thinking", "off", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"] is True
    assert report["family"] == report["family_requested"] == "glm4moe"
    assert report["thinking_modes"] == ["off"]
    assert report["roles"]["tool"]["append_only"] == "yes"
    assert report["engine"]["status"] == "not requested"


def test_cli_broken_template_exits_1_saying_where(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _save_broken_qwen3(tokenizer_dirs, tmp_path / "broken")
    rc = cli.main(["verify-template", "--tokenizer", str(path), "--thinking", "on"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[FAIL] tool_append_json[0] +tool" in out and "first differing token at index" in out
    assert "tool_response n=" in out


def test_cli_missing_tokenizer_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["verify-template", "--tokenizer", str(tmp_path / "nope")])
    assert rc == 2 and "verify-template: error" in capsys.readouterr().err
