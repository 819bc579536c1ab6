"""Every command and flag the README and `docs/` show is one the CLI takes.

The commands are read from the files themselves (`tests/fast/doc_blocks.py`): each
`session-server` command in a shell block parses with the CLI's own parser (a
`cluster` command's pass-through options with `serve`'s); each flag shown inline
(`serve --ttl-s`, a bare `--no-restart`) is in that subcommand's `--help`, or is
another program's, named below; each `TITO_*` variable is a setting. The README's
offline quick start runs as written (only its ports are free ones here), and the
README's Python examples run against it. The harness commands run in
`tests/fast/e2e/test_harnesses.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from session_server.ops import cli
from session_server.settings import ENV_PREFIX, Settings

from ..doc_blocks import DOCS, ROOT, blocks

SUBCOMMANDS = ("serve", "cluster", "sim-engine", "verify-template", "demo")

# flags the docs name that belong to other programs (the engines, mostly), with whose they are
FOREIGN_FLAGS = {
    "--enable-prompt-tokens-details": "vLLM", "--enable-scale-out": "vLLM", "--logprobs-mode": "vLLM",
    "--logits-processors": "vLLM",
    "--max-logprobs": "vLLM", "--otlp-traces-endpoint": "vLLM", "--return-sampling-mask": "vLLM",
    "--structured-outputs-config": "vLLM", "--enable-trace": "SGLang",
    "--allowedTools": "Claude Code", "--skip-git-repo-check": "Codex CLI",  # run in test_harnesses.py
}
# `TITO_*` names that are not server settings
FOREIGN_ENV = {"TITO_API_KEY": "the env_key of the README's Codex provider",
               "TITO_SCREENSHOTS": "where tests/fast/api/test_viewer_pages.py writes its screenshots"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(sub: str) -> set[str]:
    """The `--flags` a subcommand takes, read from its `--help` (a cluster takes serve's too)."""
    parsers = _subparsers()
    names = ("cluster", "serve") if sub == "cluster" else (sub,)
    text = "".join(parsers[n].format_help() for n in names)
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", text))


def _doc_text() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS]


def _shell_commands() -> list[tuple[str, list[str]]]:
    """Every `session-server ...` command of every shell (and YAML `args`) block, as argv
    after `session-server`; continuation lines joined, comments and `&` dropped."""
    out = []
    for path in DOCS:
        for b in blocks(path, langs=None):
            text = b.text.replace("\\\n", " ")
            for line in text.splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line)
                m = re.search(r"(?:^|[\s/])session-server\s+(.*)$", line)
                if not m or b.lang not in ("bash", "sh", "shell", "console", "yaml", ""):
                    continue
                for part in re.split(r"\s(?:&&|\|\||;|\|)\s", m.group(1)):
                    argv = shlex.split(part.rstrip(" &"))
                    argv = [a for a in argv if not a.startswith("$")]  # a shell variable holding more flags
                    out.append((b.where, argv))
                    break  # what follows && is another program
    return out


def test_the_docs_show_session_server_commands_in_every_shape() -> None:
    """The extraction finds what it must check (a test that finds nothing proves nothing)."""
    subs = {argv[0] for _, argv in _shell_commands() if argv}
    assert {"serve", "cluster", "sim-engine", "demo"} <= subs, subs


@pytest.mark.parametrize(("where", "argv"), _shell_commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_every_documented_command_parses(where: str, argv: list[str]) -> None:
    parser = cli.build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, rest = parser.parse_known_args(argv)
            if args.command == "cluster":  # the rest are each worker's serve options
                parser.parse_args(["serve", *rest])
            elif rest:
                parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit:
        pytest.fail(f"{where}: `session-server {shlex.join(argv)}` does not parse: {err.getvalue().strip()}")


def _inline_uses() -> list[tuple[str, str, str]]:
    """(file, subcommand or '', flag) for every flag shown in an inline code span."""
    out = []
    for name, text in _doc_text():
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            m = re.match(r"(?:\S*session-server\s+)?(serve|cluster|sim-engine|verify-template|demo)\b(.*)", span)
            if m:
                out += [(name, m.group(1), f) for f in re.findall(r"(?<![\w-])(--[a-zA-Z][\w-]*)", m.group(2))]
            elif span.startswith("--"):
                out.append((name, "", re.match(r"--[a-zA-Z][\w-]*", span).group(0)))  # type: ignore[union-attr]
    return out


def test_every_flag_shown_inline_is_in_the_help() -> None:
    uses = _inline_uses()
    assert len(uses) > 40, "the extraction found too few flags to be working"
    every = set().union(*(_flags(s) for s in SUBCOMMANDS))
    missing = sorted({f"{name}: `{(sub + ' ') if sub else ''}{flag}`" for name, sub, flag in uses
                      if flag not in (_flags(sub) if sub else every) and flag not in FOREIGN_FLAGS})
    assert not missing, f"documented flags that `--help` does not list: {missing}"


def test_every_documented_environment_variable_is_a_setting() -> None:
    settings = {ENV_PREFIX + f.upper() for f in Settings.model_fields}
    named = {(name, v) for name, text in _doc_text() for v in re.findall(r"\bTITO_[A-Z0-9_]+", text)}
    assert len(named) > 5
    missing = sorted(f"{name}: {v}" for name, v in named if v not in settings and v not in FOREIGN_ENV)
    assert not missing, f"documented TITO_* variables that are no setting: {missing}"


def test_every_simulator_fault_kind_is_documented() -> None:
    from session_server.sim import FAULT_KINDS

    api = (ROOT / "docs" / "api.md").read_text()
    table = api[api.index("Fault kinds (`session_server.sim.FAULT_KINDS`)"):]
    assert not [k for k in FAULT_KINDS if f"`{k}`" not in table]


def test_the_docs_cite_no_internal_issue_numbers() -> None:
    """A reader has no access to the team's tracker: "issue 12.2" tells them nothing."""
    texts = [*_doc_text(), ("pyproject.toml", (ROOT / "pyproject.toml").read_text())]
    found = [f"{name}: {m.group(0)}" for name, text in texts
             for m in re.finditer(r"(?<!/)\bissues? #?\d+(\.\d+)?\b", text, re.I)]
    assert not found


def test_samples_doc_describes_history_rewrite_as_turns_record_it() -> None:
    """docs/samples.md said the field was "None for now" after turns began to record it."""
    from types import SimpleNamespace

    from session_server.turn.prepare import _history_rewrite

    recorded = _history_rewrite(SimpleNamespace(prev_output=(1, 40, 60)), 3)  # type: ignore[arg-type]
    doc = " ".join((ROOT / "docs" / "samples.md").read_text().split())
    assert "None for now" not in doc
    assert all(f'"{key}"' in doc for key in recorded), (sorted(recorded), "docs/samples.md")


def test_switch_flags_do_not_show_a_misleading_default() -> None:
    """`--no-restart ... (default: True)` reads as "no restart is the default"."""
    help_text = " ".join(_subparsers()["cluster"].format_help().split())
    assert "--no-restart leave a dead worker dead (default: restart it" in help_text
    assert "(default: True)" not in help_text and "(default: False)" not in help_text


# --- the README's offline quick start and its Python examples, run -----------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args} exited {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


@contextlib.contextmanager
def _readme_offline_stack(tmp_path: Path) -> Iterator[str]:
    """The README's "fully offline" lines as written, on free ports; yields the server URL."""
    block = next(b.text for b in blocks(ROOT / "README.md") if "fully offline" in b.text)
    lines = block.split("# fully offline", 1)[1].splitlines()[1:]
    sim_line, serve_line = (ln.strip() for ln in lines if ln.startswith("session-server"))
    assert sim_line.endswith("--port 30000 &") and serve_line.endswith("--port 8000"), (sim_line, serve_line)
    engine, server = _free_port(), _free_port()
    sim = shlex.split(sim_line.rstrip("&").replace("30000", str(engine)))
    serve = shlex.split(serve_line.replace("30000", str(engine)).replace("8000", str(server)))
    exe = [sys.executable, "-m", "session_server.ops.cli"]  # this checkout's `session-server`
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        with open(tmp_path / "sim.log", "wb") as sim_log, open(tmp_path / "serve.log", "wb") as serve_log:
            procs.append(subprocess.Popen([*exe, *sim[1:]], env=env, stdout=sim_log, stderr=subprocess.STDOUT))
            _wait(f"http://127.0.0.1:{engine}/health", procs[0])
            procs.append(subprocess.Popen([*exe, *serve[1:]], env=env, stdout=serve_log, stderr=subprocess.STDOUT))
            _wait(f"http://127.0.0.1:{server}/health", procs[1])
            yield f"http://127.0.0.1:{server}"
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_readme_quick_start_and_python_examples_run_as_written(tmp_path: Path) -> None:
    pytest.importorskip("openai", reason="the README's examples use the openai client")
    python = [b.text for b in blocks(ROOT / "README.md", langs=("python",))]
    first = next(t for t in python if "all the agent needs" in t)
    samples = next(t for t in python if "load_samples_safetensors" in t)
    with _readme_offline_stack(tmp_path) as url:
        for code in (first, samples):
            run = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000", url)],
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                                 timeout=120)
            assert run.returncode == 0, f"{code}\n{run.stderr[-3000:]}"
    printed = run.stdout.splitlines()
    shown = [ln[2:] for ln in samples.splitlines() if ln.startswith("# t")]
    assert [ln.split(" {")[0] for ln in printed] == [ln.split(" {")[0] for ln in shown], (printed, shown)
