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
    assert "family: llama3.1" in out and "append-only" in out and out.rstrip().splitlines()[-1].startswith("OK: ")
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


def test_qwen3_report_says_in_one_line_what_was_checked_and_what_holds(
        tokenizer_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3 re-renders history on a user turn: that used to read `user append-only: no,
    bridge exact 0/0`, twelve `[note]` lines, then a bare `OK`."""
    rc = cli.main(["verify-template", "--tokenizer", str(tokenizer_dirs["qwen3"])])
    out = capsys.readouterr().out
    assert rc == 0, out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("OK: 16 appended steps (thinking on, off): 4/4 bridged token-exact"), last
    assert "12 where the template re-renders earlier turns" in last and "16/16 assistant messages parse back" in last
    assert "[note]" not in out and "0/0" not in out
    assert "reported, not failed: 12 step(s): rewrite +user x8" in out
    assert len(out.splitlines()) < 20, out


def test_json_piped_into_head_stops_quietly(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    """`verify-template --json | head` used to end in a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    cmd = (f"{sys.executable} -m session_server.ops.cli verify-template --tokenizer "
           f"{tokenizer_dirs['qwen3']} --json | head -2")
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.stdout == '{\n  "ok": true,\n', run.stdout
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr


def test_toy_tokenizer_is_refused_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    """`sim-engine --tokenizer toy` works; `verify-template` (and `serve`) cannot use it:
    the refusal says it has no chat template and what to pass instead."""
    rc = cli.main(["verify-template", "--tokenizer", "toy"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "'toy' is the simulator's byte-level tokenizer" in err and "no chat template" in err
    assert "qwen3" in err and "not in the local cache" not in err
