"""Real agent harnesses, end to end, against the server and a simulated engine.

Each harness runs one whole episode against a session's base URL: the simulated model is
scripted (`/sim/script`, `ScriptedPolicy.set_script`) to call one of the harness's own
tools and then to finish the way the harness expects. The test asserts the harness
finished (exit code 0 / its final answer) and that the stored trajectory's sampled ids,
logprobs and loss mask equal the engine's log exactly (`assert_trajectory_matches_engine`).

A harness that is not installed skips its test with the reason:
- mini-swe-agent: `pip install mini-swe-agent` (Python package `minisweagent`);
- Claude Code: `npm install -g --prefix DIR @anthropic-ai/claude-code`; `claude` on PATH
  or `$TITO_CLAUDE_BIN`;
- Codex CLI: `npm install -g --prefix DIR @openai/codex`; `codex` on PATH or `$TITO_CODEX_BIN`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from session_server.api.dialects.anthropic_messages import AnthropicMessages

from ..doc_blocks import shell_block
from ..stack import Stack, live_stack
from .test_openai_client_episodes import assert_trajectory_matches_engine

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def _tool(env_var: str, name: str) -> str:
    """The harness executable: `$env_var`, else `name` on PATH; skips when neither."""
    path = os.environ.get(env_var) or shutil.which(name)
    if not path or not Path(path).exists():
        pytest.skip(f"{name} is not installed (put it on PATH or set ${env_var})")
    return path


async def _run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
    """Run a harness CLI without blocking the loop the server runs on."""
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return int(proc.returncode or 0), out.decode(errors="replace"), err.decode(errors="replace")


README_SESSION = shell_block("curl -s -X POST")
README_CLAUDE = shell_block("claude -p")
README_CODEX = shell_block("codex exec")
README_SERVER = "http://127.0.0.1:8000"


async def _run_readme(st: Stack, block: str, *, cwd: Path, env: dict[str, str]) -> tuple[int, str, str, str]:
    """The README's session block then `block`, as written, in bash; only the server URL
    is this test's. Returns the harness's exit code, stdout and stderr (the session id
    is echoed to stderr after it, for the test to read the trajectory)."""
    assert README_SERVER in README_SESSION
    script = "\n".join([README_SESSION.replace(README_SERVER, st.url), block.rstrip(), "rc=$?",
                        'echo "tito-test-sid=$SID" >&2', "exit $rc"])
    rc, out, err = await _run(["bash", "-c", script], cwd=cwd, env=env)
    sids = [line.split("=", 1)[1] for line in err.splitlines() if line.startswith("tito-test-sid=")]
    assert sids and sids[-1], f"the README's session block made no session: {err[-2000:]}"
    return rc, out, err, sids[-1]


async def _one_branch(st: Stack, sid: str, tag: str) -> dict[str, Any]:
    """The session's single branch, checked against the engine's log; returned."""
    traj = await st.trajectory(sid)
    log = await st.engine_log()
    assert len(traj["branches"]) == 1, f"{tag}: the episode forked: {[len(b['turns']) for b in traj['branches']]}"
    branch: dict[str, Any] = traj["branches"][0]
    assert_trajectory_matches_engine(branch, log, tag)
    return branch


def assert_every_branch_matches_engine(traj: dict[str, Any], log: list[dict[str, Any]], tag: str) -> None:
    """`assert_trajectory_matches_engine` for sessions with several branches (a harness's
    side requests, such as Claude Code's title, start their own): every turn of every
    branch is one served engine request (prompt, sampled ids, logprobs), the mask is 1
    exactly on sampled ids, and every served request is some turn."""
    served = [r for r in log if r["status"] == 200]
    used: set[int] = set()
    for k, branch in enumerate(traj["branches"]):
        ids, mask = branch["token_ids"], np.asarray(branch["loss_mask"])
        lps = np.asarray(branch["logprobs"], dtype=np.float32)
        expected = np.zeros_like(mask)
        for turn in branch["turns"]:
            a, b = turn["output_start"], turn["output_end"]
            hits = [i for i, r in enumerate(served) if r["input_ids"] == ids[:a] and r["output_ids"] == ids[a:b]]
            assert hits, f"{tag}: branch {k} turn {turn['index']} is no engine request"
            used.add(hits[0])
            np.testing.assert_array_equal(lps[a:b], np.asarray(served[hits[0]]["logprobs"], dtype=np.float32),
                                          err_msg=tag)
            expected[a:b] = 1
        np.testing.assert_array_equal(mask, expected, err_msg=f"{tag}: mask must be 1 exactly on sampled ids")
        assert np.all(lps[mask == 0] == 0.0), tag
    assert used == set(range(len(served))), f"{tag}: engine requests no turn stores"


# --- mini-swe-agent (litellm, chat completions) ------------------------------------------

MINI_SCRIPT = [
    {"reasoning_content": "Let me look at the file first.",
     "tool_calls": [{"name": "bash", "arguments": {"command": "cat notes.txt"}}]},
    {"reasoning_content": "The notes say hello. Submit.",
     "tool_calls": [{"name": "bash", "arguments": {"command": f"echo {SUBMIT} && cat notes.txt"}}]},
]


def _mini_episode(base_url: str, cwd: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One mini-swe-agent episode (its `mini.yaml` config, tool-calling `LitellmModel`,
    local environment in `cwd`); returns (exit info, the agent's messages)."""
    import minisweagent
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    config = yaml.safe_load((Path(minisweagent.package_dir) / "config" / "mini.yaml").read_text())
    agent_cfg = {k: v for k, v in config["agent"].items() if k in ("system_template", "instance_template")}
    model = LitellmModel(model_name="openai/m", cost_tracking="ignore_errors",
                         model_kwargs={"api_base": base_url, "api_key": "x", "max_tokens": 256},
                         **{k: v for k, v in config["model"].items() if k.endswith("_template")})
    env = LocalEnvironment(cwd=str(cwd), **config.get("environment", {}))
    agent = DefaultAgent(model, env, step_limit=6, **agent_cfg)
    info = agent.run("Print the notes and submit.")
    return info, agent.messages


async def test_mini_swe_agent_episode_trajectory_equals_engine_io(
        qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea-config"))  # not the user's config
    pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (pip install mini-swe-agent)")
    (tmp_path / "notes.txt").write_text("hello from the sandbox\n")
    async with live_stack(qwen3_dir, "sglang", script=MINI_SCRIPT) as st:
        sid = await st.session()
        info, messages = await asyncio.to_thread(_mini_episode, f"{st.url}/sessions/{sid}/v1", tmp_path)
        branch = await _one_branch(st, sid, "mini-swe-agent")
    assert info["exit_status"] == "Submitted", info
    assert info["submission"] == "hello from the sandbox\n"
    calls = [json.loads(tc["function"]["arguments"])["command"]
             for m in messages if m["role"] == "assistant" for tc in m.get("tool_calls") or []]
    assert calls == ["cat notes.txt", f"echo {SUBMIT} && cat notes.txt"]
    assert len(branch["turns"]) == 2
    # the observation of the first command reached the model's context
    assert any("hello from the sandbox" in str(m.get("content")) for m in branch["messages"] if m["role"] == "tool")


async def test_sim_script_route_sets_and_validates(qwen3_dir: Path) -> None:
    """The scripting hook the harness tests use: a scripted turn is what the model says."""
    async with live_stack(qwen3_dir, "vllm") as st:
        async with httpx.AsyncClient() as c:
            bad = await c.post(f"{st.engines[0]}/sim/script", json={"turns": [{"tool_calls": [{"name": 3}]}]})
            assert bad.status_code == 400 and "tool call" in bad.json()["error"]
            ok = await c.post(f"{st.engines[0]}/sim/script", json={"turns": [{"content": "Scripted."}]})
            assert ok.status_code == 200, ok.text
        sid = await st.session()
        r = await st.chat(sid)
        assert r.json()["choices"][0]["message"]["content"] == "Scripted."


# --- Claude Code (Anthropic Messages, streamed) -------------------------------------------


def test_messages_accepts_what_claude_code_sends() -> None:
    """Claude Code's requests: a `system` message inside `messages` (beta
    `mid-conversation-system-2026-04-07`) and `output_config.format` (its title
    side-request's structured output) used to be a 400 and ignored."""
    from session_server.api.dialects.anthropic_messages import ANTHROPIC_MESSAGES
    from session_server.errors import BadRequest

    body = {"model": "m", "max_tokens": 64, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {
                "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}},
            "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": "Agent types: ..."},
                         {"role": "system", "content": [{"type": "text", "text": "more"}]}]}
    req = ANTHROPIC_MESSAGES.parse(json.dumps(body).encode())
    assert req.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                            {"role": "system", "content": "Agent types: ..."}, {"role": "system", "content": "more"}]
    assert req.response_format is not None and req.response_format.type == "json_schema"
    assert req.response_format.json_schema is not None
    assert req.response_format.json_schema.schema_ == body["output_config"]["format"]["schema"]  # type: ignore[index]
    for bad in ({"output_config": {"format": {"type": "regex"}}},
                {"messages": [{"role": "system", "content": 3}]}):
        with pytest.raises(BadRequest):
            ANTHROPIC_MESSAGES.parse(json.dumps({**body, **bad}).encode())

CLAUDE_SCRIPT = [
    {"reasoning_content": "Read the notes.",
     "tool_calls": [{"name": "Bash", "arguments": {"command": "cat notes.txt", "description": "Print the notes"}}]},
    {"reasoning_content": "Got it.", "content": "The notes say hello."},
]


async def test_claude_code_episode_trajectory_equals_engine_io(qwen3_dir: Path, tmp_path: Path) -> None:
    """The README's Claude Code commands, pasted as written (only `SERVER` is this test's
    server): a session from `POST /sessions`, then `claude -p ... --output-format json
    --allowedTools Bash` with ANTHROPIC_BASE_URL = the session root. Its streamed Messages
    requests (system blocks with cache_control, 25 built-in tools, adaptive thinking,
    mid-conversation system messages, betas) run a Bash tool call and answer; its title
    side-request (structured output) is a branch of its own."""
    claude = _tool("TITO_CLAUDE_BIN", "claude")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello from the sandbox\n")
    async with live_stack(qwen3_dir, "sglang", script=CLAUDE_SCRIPT) as st:
        env = {"PATH": f"{Path(claude).parent}:{os.environ.get('PATH', '')}", "HOME": str(tmp_path),
               "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "DISABLE_AUTOUPDATER": "1"}
        rc, out, err, sid = await _run_readme(st, README_CLAUDE, cwd=work, env=env)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert rc == 0, f"claude exited {rc}: {out[-2000:]} {err[-2000:]}"
    result = json.loads(out)
    assert result["is_error"] is False and result["result"] == "The notes say hello.", result
    assert_every_branch_matches_engine(traj, log, "claude-code")
    main = max(traj["branches"], key=lambda b: len(b["turns"]))
    assert len(main["turns"]) == 2
    tool_msgs = [m for m in main["messages"] if m["role"] == "tool"]
    assert tool_msgs and "hello from the sandbox" in str(tool_msgs[0]["content"])
    # lineage, as 2.1.197 sends it: its main agent's turns name its session (x-claude-code-session-id)
    lineages = [t["lineage"] for b in traj["branches"] for t in b["turns"]]
    assert all(x is not None and x["kind"] == "main" and x["source"] == "x-claude-code-session-id" for x in lineages), \
        lineages
    assert len({x["thread"] for x in lineages}) == 1


CLAUDE_SUBAGENT_SCRIPT = [
    {"reasoning_content": "Delegate.", "tool_calls": [{"name": "Agent", "arguments": {
        "description": "Read notes", "prompt": "Print the notes", "subagent_type": "general-purpose"}}]},
    {"reasoning_content": "Done.", "content": "The notes say hello."},
]


async def test_claude_code_sub_agent_turns_are_labelled_with_its_agent_id(qwen3_dir: Path, tmp_path: Path) -> None:
    """Claude Code 2.1.197's Agent tool: the sub-agent's requests carry
    `x-claude-code-agent-id` (the main agent's do not), so its turns are labelled
    `subagent` with that id, their parent the main agent's session id. (The scripted
    model answers the sub-agent's first request with an Agent call too; a sub-agent has
    no Agent tool, so Claude Code answers it with an error and the sub-agent finishes.)"""
    claude = _tool("TITO_CLAUDE_BIN", "claude")
    work = tmp_path / "work"
    work.mkdir()
    async with live_stack(qwen3_dir, "sglang", script=CLAUDE_SUBAGENT_SCRIPT) as st:
        sid = await st.session()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANTHROPIC_API_KEY": "x",
               "ANTHROPIC_BASE_URL": f"{st.url}/sessions/{sid}", "DISABLE_TELEMETRY": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
        rc, out, err = await _run([claude, "-p", "Print the notes", "--output-format", "json",
                                   "--allowedTools", "Bash,Agent"], cwd=work, env=env)
        traj = await st.trajectory(sid)
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert rc == 0, f"claude exited {rc}: {out[-2000:]} {err[-2000:]}"
    turns = sorted((t for b in traj["branches"] for t in b["turns"]), key=lambda t: t["seq"])
    main = [t["lineage"] for t in turns if t["lineage"]["kind"] == "main"]
    subs = [t["lineage"] for t in turns if t["lineage"]["kind"] == "subagent"]
    assert len(main) >= 2 and subs, [t["lineage"] for t in turns]
    session_id = main[0]["thread"]
    assert {m["thread"] for m in main} == {session_id} and session_id
    assert {s["source"] for s in subs} == {"x-claude-code-agent-id"}
    assert {(s["agent"], s["parent"]) for s in subs} == {(subs[0]["agent"], session_id)}
    assert [(a["agent"], a["kind"]) for a in view["agents"]] == [("main", "main"), (subs[0]["agent"], "subagent")]


# --- Codex CLI (OpenAI Responses, streamed) -----------------------------------------------

CODEX_SCRIPT = [
    {"reasoning_content": "Read the notes.",
     "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat notes.txt"}}]},
    {"reasoning_content": "Got it.", "content": "The notes say hello."},
]


def test_responses_leaves_tools_it_cannot_call_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Codex always sends a `namespace` group and the hosted `web_search` (and, for some
    models, the freeform `custom` apply_patch): they were a 400, which stopped Codex."""
    from session_server.api.dialects.openai_responses_request import chat_tools

    fn = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
    tools = [fn, {"type": "namespace", "name": "multi_agent_v1", "tools": []}, {"type": "web_search"},
             {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}]
    with caplog.at_level("WARNING", logger="session_server"):
        out = chat_tools(tools)
    assert out == [{"type": "function", "function": {"name": "exec_command", "parameters": {"type": "object"}}}]
    assert "namespace:multi_agent_v1, web_search, custom:apply_patch" in caplog.text
    assert chat_tools([{"type": "web_search"}]) is None


CODEX_CONFIG = """model = "m"
model_provider = "tito"

[model_providers.tito]
name = "tito session server"
base_url = "{base_url}"
env_key = "TITO_API_KEY"
wire_api = "responses"
"""


async def test_codex_exec_episode_trajectory_equals_engine_io(qwen3_dir: Path, tmp_path: Path) -> None:
    """The README's Codex commands, pasted as written (only `SERVER` is this test's
    server): a session, a custom Responses provider in `$CODEX_HOME/config.toml` whose
    base_url is the session's /v1, then `codex exec --skip-git-repo-check -s
    workspace-write ... </dev/null`. Its streamed requests (`store: false`, `include:
    [reasoning.encrypted_content]`, a `namespace` tool group and the hosted `web_search`,
    which are left out of the prompt) run an `exec_command` call and answer, on one branch."""
    codex = _tool("TITO_CODEX_BIN", "codex")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello from the sandbox\n")
    async with live_stack(qwen3_dir, "vllm", script=CODEX_SCRIPT) as st:
        env = {"PATH": f"{Path(codex).parent}:{os.environ.get('PATH', '')}", "HOME": str(tmp_path)}
        rc, out, err, sid = await _run_readme(st, README_CODEX, cwd=work, env=env)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert rc == 0, f"codex exited {rc}: {out[-2000:]} {err[-2000:]}"
    assert out.strip().splitlines()[-1] == "The notes say hello.", out  # its last message, on stdout
    assert (work / ".codex-tito" / "config.toml").exists()  # where the README puts it, not ~/.codex
    branch = traj["branches"][0]
    assert len(traj["branches"]) == 1 and len(branch["turns"]) == 2
    assert_trajectory_matches_engine(branch, log, "codex")
    # lineage, as 0.169.0 sends it: x-codex-turn-metadata's agent_name "/root" and thread_id
    assert [t["lineage"]["source"] for t in branch["turns"]] == ["x-codex-turn-metadata"] * 2
    assert {(t["lineage"]["agent"], t["lineage"]["kind"]) for t in branch["turns"]} == {("main", "main")}
    assert len({t["lineage"]["thread"] for t in branch["turns"]}) == 1 and branch["turns"][0]["lineage"]["thread"]
    tool_msgs = [m for m in branch["messages"] if m["role"] == "tool"]
    assert tool_msgs and "hello from the sandbox" in str(tool_msgs[0]["content"])


async def test_claude_code_with_a_wrong_key_stops_at_once_and_says_why(qwen3_dir: Path, tmp_path: Path) -> None:
    """With auth on, a wrong `ANTHROPIC_API_KEY` used to keep Claude Code silent for
    minutes: it retries a 401 (it might refresh its key) unless the answer says
    `x-should-retry: false`. Now it exits non-zero at once with the server's reason, and
    the server sees a bounded number of requests."""
    from session_server.context import Settings

    from ..stack import metric_value

    claude = _tool("TITO_CLAUDE_BIN", "claude")
    async with live_stack(qwen3_dir, "sglang", settings=Settings(admin_token="admin-secret")) as st:
        st.http.headers["authorization"] = "Bearer admin-secret"
        sid = await st.session()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANTHROPIC_API_KEY": "wrong",
               "ANTHROPIC_BASE_URL": f"{st.url}/sessions/{sid}", "DISABLE_TELEMETRY": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
        rc, out, err = await _run([claude, "-p", "say hi"], cwd=tmp_path, env=env, timeout=45)
        denied = metric_value((await st.http.get("/metrics")).text, "tito_errors_total", type="unauthorized")
    assert rc != 0, out
    # its own words for an authentication_error about the key, or the server's message
    assert "Invalid API key" in out + err or "invalid credentials" in out + err, (out, err)
    assert 1 <= denied <= 3, f"the server answered {denied} x 401"


# --- keep-alives through a pause (a harness's idle watchdog) ------------------------------

PAUSE_S = 14.0  # longer than each harness's watchdog below


async def _paused_episode(st: Stack, argv: list[str], *, cwd: Path, env: dict[str, str], sid: str = "",
                          after_turns: int = 0, ahead: dict[str, Any] | None = None,
                          pause_s: float = PAUSE_S) -> tuple[int, str, str]:
    """Run the harness while the engines are paused for `pause_s` (the control plane's
    pause and resume, as a weight update does), from the start or once `after_turns`
    turns of session `sid` committed: the next turn waits that long. From the start with
    `sid`, the pause is counted from the harness's first turn taking the session (its
    start-up is not part of the wait). With `ahead` (a chat body), that chat is sent on
    session `sid` once the engines paused and before the harness starts: it holds the
    session at the pause gate, so the harness's first request waits in the session's
    queue (as Claude Code's main request does behind its title side-request)."""
    st.http.timeout = httpx.Timeout(60)
    side: asyncio.Task[httpx.Response] | None = None

    async def busy() -> bool:
        return bool((await st.http.get(f"/sessions/{sid}")).json()["busy"])

    if not after_turns:
        r = await st.http.post("/control/pause", json={"mode": "abort"})
        assert r.status_code == 200, r.text
    if ahead is not None:
        side = asyncio.create_task(st.chat(sid, ahead))
        while not await busy():
            assert not side.done(), side.result().text
            await asyncio.sleep(0.01)
    run = asyncio.create_task(_run(argv, cwd=cwd, env=env, timeout=120))
    while after_turns:
        traj = await st.trajectory(sid)
        if sum(len(b["turns"]) for b in traj["branches"]) >= after_turns:
            r = await st.http.post("/control/pause", json={"mode": "abort"})
            assert r.status_code == 200, r.text
            break
        assert not run.done(), f"the harness ended before the pause: {run.result()}"
        await asyncio.sleep(0.01)
    while sid and not after_turns and side is None and not await busy():
        assert not run.done(), f"the harness ended before its first turn: {run.result()}"
        await asyncio.sleep(0.01)
    await asyncio.sleep(pause_s)
    assert not run.done(), f"the harness ended during the pause: {run.result()}"
    r = await st.http.post("/control/resume", json={})
    assert r.status_code == 200, r.text
    if side is not None:
        assert (await side).status_code == 200
    return await run


async def test_codex_runs_an_episode_through_a_pause_longer_than_its_idle_watchdog(
        qwen3_dir: Path, tmp_path: Path) -> None:
    """Codex aborts a Responses stream with no event for `stream_idle_timeout_ms` (here
    3 s; 300 s by default): an SSE comment is no event to it, `response.in_progress`
    every `keepalive_s` is; through a 14 s pause: no abort, one branch equal to the
    engine I/O."""
    from session_server.context import Settings

    codex = _tool("TITO_CODEX_BIN", "codex")
    work, home = tmp_path / "work", tmp_path / "codex-home"
    work.mkdir()
    home.mkdir()
    (work / "notes.txt").write_text("hello from the sandbox\n")
    last = tmp_path / "last.txt"
    async with live_stack(qwen3_dir, "vllm", script=CODEX_SCRIPT, settings=Settings(keepalive_s=1.0)) as st:
        sid = await st.session()
        config = CODEX_CONFIG.format(base_url=f"{st.url}/sessions/{sid}/v1")
        (home / "config.toml").write_text(config + "stream_idle_timeout_ms = 3000\nstream_max_retries = 0\n")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CODEX_HOME": str(home),
               "TITO_API_KEY": "x"}
        rc, out, err = await _paused_episode(st, [codex, "exec", "--skip-git-repo-check", "--ephemeral",
                                                  "-o", str(last), "Print the notes"], cwd=work, env=env)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
        view = (await st.http.get(f"/sessions/{sid}")).json()
    assert rc == 0, f"codex exited {rc}: {out[-2000:]} {err[-2000:]}"
    assert last.read_text().strip() == "The notes say hello."
    assert view["turns_discarded"] == 0, "a turn was abandoned (the client aborted and retried)"
    branch = traj["branches"][0]
    assert len(traj["branches"]) == 1 and len(branch["turns"]) == 2
    assert_trajectory_matches_engine(branch, log, "codex-paused")


# Claude Code's idle watchdogs (2.1.197, read in its bundle): its byte watchdog
# (`CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS`, 180 s, floor 10 s) wraps a streamed response's body
# once its headers came, and only for api.anthropic.com (forced on here); elsewhere Bun's
# own socket idle timeout (`BUN_CONFIG_HTTP_IDLE_TIMEOUT`, 300 s) counts every byte, headers
# or not, so it is what a request still waiting for its headers meets on a custom base URL.
CLAUDE_WATCHDOGS = {
    # its stream began, then waits at the pause gate: pings must reach the byte watchdog
    "byte_watchdog_on_its_stream": {"_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL": "1",
                                    "CLAUDE_ENABLE_BYTE_WATCHDOG": "1",
                                    "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000"},
    # queued for the session behind a turn at the pause gate, before any byte of its response
    "socket_idle_while_queued": {"BUN_CONFIG_HTTP_IDLE_TIMEOUT": "10"},
}


QUEUED_PAUSE_S = 22.0  # from before Claude Code starts: its first request (0.3-6 s in) waits well over 10 s


@pytest.mark.parametrize("watchdog", list(CLAUDE_WATCHDOGS))
async def test_claude_code_runs_an_episode_through_a_pause_longer_than_its_idle_watchdog(
        qwen3_dir: Path, tmp_path: Path, watchdog: str) -> None:
    """Claude Code abandons a request silent for its idle watchdog (10 s here; 180 s or
    300 s by default, see CLAUDE_WATCHDOGS) and sends it again (or falls back to a
    non-streamed request): a duplicate turn. Through a pause longer than the watchdog,
    with `keepalive_s` 1 s: no abort, every branch equal to the engine I/O, the
    episode's answer right; both where its stream waits at the pause gate for 14 s
    (pings after `message_start`) and where its request waits in the session's queue
    behind a turn held there (the response begins after `keepalive_s`: headers, then
    pings before `message_start`). With TITO_TEST_KEEPALIVE_S=300 both fail."""
    from session_server.context import Settings

    from ..stack import metric_value

    claude = _tool("TITO_CLAUDE_BIN", "claude")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello from the sandbox\n")
    keepalive_s = float(os.environ.get("TITO_TEST_KEEPALIVE_S", "1"))  # 300: shows the watchdog fires
    queued = watchdog == "socket_idle_while_queued"
    ahead = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "A side question."}],
             "tools": [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]}
    async with live_stack(qwen3_dir, "sglang", script=CLAUDE_SCRIPT, settings=Settings(keepalive_s=keepalive_s)) as st:
        sid = await st.session()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANTHROPIC_API_KEY": "x",
               "ANTHROPIC_BASE_URL": f"{st.url}/sessions/{sid}", "DISABLE_TELEMETRY": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
               **CLAUDE_WATCHDOGS[watchdog]}
        rc, out, err = await _paused_episode(st, [claude, "-p", "Print the notes", "--output-format", "json",
                                                  "--allowedTools", "Bash"], cwd=work, env=env, sid=sid,
                                             ahead=ahead if queued else None,
                                             pause_s=QUEUED_PAUSE_S if queued else PAUSE_S)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
        view = (await st.http.get(f"/sessions/{sid}")).json()
        metrics = (await st.http.get("/metrics")).text
    assert rc == 0, f"claude exited {rc}: {out[-2000:]} {err[-2000:]}"
    result = json.loads(out)
    assert result["is_error"] is False and result["result"] == "The notes say hello.", result
    # an abandoned request comes back as a new one (Claude Code retries a timed-out request
    # itself, or falls back to a non-streamed one): the same turn once more on a new branch
    turns = sum(len(b["turns"]) for b in traj["branches"])
    assert turns == 2 + queued, f"Claude Code abandoned a request and sent it again ({turns} turns)"
    assert view["turns_discarded"] == 0, "a turn was abandoned (the client aborted)"
    retries = sum(metric_value(metrics, "tito_replays_total", source=s) for s in ("in_flight", "stored"))
    assert retries == 0, f"Claude Code's SDK retried a request ({retries:g} retries)"
    # first-party mode makes Claude Code resend its first answer slightly changed (a history
    # rewrite: a branch of its own), so its turns are not always on one branch
    assert_every_branch_matches_engine(traj, log, f"claude-code-paused-{watchdog}")


async def test_claude_code_side_request_temperature_is_pinned_at_the_engine_and_recorded(
        qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claude Code chooses sampling values per request: pointed at a model it may set a
    temperature for (`--model claude-sonnet-4-20250514`; for its default model it sends
    none), its title side-request (thinking disabled, no tools) carries
    `temperature: 1` and its main turns none. In a session pinned at 0.7 the engine gets
    0.7 on every request, and each turn records what Claude Code sent (read here from the
    raw bodies, before the server touches them)."""
    claude = _tool("TITO_CLAUDE_BIN", "claude")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("hello from the sandbox\n")
    sent: list[dict[str, Any]] = []
    parse = AnthropicMessages.parse

    def spy(self: AnthropicMessages, body: bytes) -> Any:
        sent.append(json.loads(body))
        return parse(self, body)

    monkeypatch.setattr(AnthropicMessages, "parse", spy)
    async with live_stack(qwen3_dir, "sglang", script=CLAUDE_SCRIPT) as st:
        sid = await st.session(sampling_policy="pinned", sampling={"temperature": 0.7, "top_p": 1.0}, seed=4)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "ANTHROPIC_API_KEY": "x",
               "ANTHROPIC_BASE_URL": f"{st.url}/sessions/{sid}", "DISABLE_TELEMETRY": "1",
               "DISABLE_AUTOUPDATER": "1"}
        rc, out, err = await _run([claude, "-p", "Print the notes", "--output-format", "json", "--allowedTools",
                                   "Bash", "--model", "claude-sonnet-4-20250514"], cwd=work, env=env)
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert rc == 0, f"claude exited {rc}: {out[-2000:]} {err[-2000:]}"
    own = [b for b in sent if "temperature" in b]
    assert own, f"Claude Code sent no temperature of its own: {[sorted(b) for b in sent]}"
    title = own[0]
    assert title["temperature"] == 1 and title["thinking"] == {"type": "disabled"}
    assert title["tools"] == [] and "Write the title" in json.dumps(title["messages"])  # its title request
    served = [r for r in log if r["status"] == 200]
    turns = [t for b in traj["branches"] for t in b["turns"]]
    assert len(served) == len(turns) == len(sent) >= 3  # the title side-request and the two scripted turns
    assert [r["sampling_params"]["temperature"] for r in served] == [0.7] * len(served)
    records = [t["extra"]["sampling"] for t in turns]
    assert sorted(r["client"].get("temperature", -1) for r in records) == \
        sorted(b.get("temperature", -1) for b in sent)
    for r in records:
        assert r["policy"] == "pinned" and r["engine"]["temperature"] == 0.7
        assert ("temperature" in r["overridden"]) == ("temperature" in r["client"])
    assert sorted(r["seeds"][0] for r in records) == sorted(q["sampling_params"]["sampling_seed"] for q in served)
