"""`session-server cluster` = N `serve` workers behind HAProxy, end to end.

Sessions created through the proxy land on several instances; every turn of a
session reaches its instance (real `openai` client, trajectories token-exact with
the simulated engine's log); killing one worker fails only its sessions, with a
503 `instance_unavailable` naming it, while the others keep working. Skipped only
when `haproxy` is absent (`.ci/run` installs it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from session_server.ops import cli
from session_server.ops.cluster import WorkerSpec, free_ports, haproxy_config
from session_server.sim import running_sim

from ..e2e.test_openai_client_episodes import assert_trajectory_matches_engine

HAVE_HAPROXY = shutil.which("haproxy") is not None
needs_haproxy = pytest.mark.skipif(not HAVE_HAPROXY, reason="haproxy is not installed (apt-get install haproxy)")
READY_S = 240.0


def test_missing_haproxy_names_the_debian_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PATH", "")
    rc = cli.main(["cluster", "--workers", "2", "--port", "1", "--engine", "sglang=http://127.0.0.1:9",
                   "--tokenizer", "qwen3"])
    err = capsys.readouterr().err
    assert rc == 2 and "apt-get install haproxy" in err and "'haproxy'" in err


def test_cluster_sets_the_worker_identity_itself(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["cluster", "--engine", "http://x:1", "--tokenizer", "t", "--instance-id", "a"])
    assert rc == 2 and "--instance-id" in capsys.readouterr().err
    rc = cli.main(["cluster", "--workers", "0", "--engine", "http://x:1", "--tokenizer", "t"])
    assert rc == 2 and "--workers must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bad serve option fails before anything starts
        cli.main(["cluster", "--engine", "http://x:1", "--tokenizer", "t", "--no-such-flag", "1"])


@needs_haproxy
def test_generated_config_is_valid_for_64_workers(tmp_path: Path) -> None:
    workers = [WorkerSpec(f"w{i}", 20000 + i) for i in range(64)]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(workers, bind_host="127.0.0.1", port=19999, directory=tmp_path))
    check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr
    assert (tmp_path / "instances.map").read_text().splitlines()[63] == "w63 be_w63"
    assert '"instance_unavailable"' in (tmp_path / "503_w7.http").read_text()


@dataclass
class Cluster:
    url: str
    workers: dict[str, tuple[int, str]]  # instance -> (pid, direct URL)
    log: Path
    proc: asyncio.subprocess.Process

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.asynccontextmanager
async def running_cluster(
    tokenizer_dir: Path, engine: str, workers: int, tmp_path: Path, *extra: str,
) -> AsyncIterator[Cluster]:
    """`session-server cluster` as a subprocess on a free port; always torn down (SIGTERM,
    then SIGKILL of the cluster and of every worker pid it reported)."""
    port = free_ports(1)[0]
    log = tmp_path / "cluster.log"
    with log.open("wb") as out:  # a file, not a pipe: nobody has to drain it
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "session_server.ops.cli", "cluster", "--workers", str(workers), "--port", str(port),
            "--engine", f"sglang={engine}", "--tokenizer", str(tokenizer_dir), "--cpu-workers", "1",
            "--decode-processes", "0", "--log-level", "warning", "--drain-timeout-s", "2",
            *(() if "--no-journal" in extra else ("--journal-dir", str(tmp_path / "journal"))), *extra,
            stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    cluster = Cluster(f"http://127.0.0.1:{port}", {}, log, proc)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_S
        while "cluster ready" not in cluster.log_text():
            assert proc.returncode is None, f"cluster exited early:\n{cluster.log_text()[-3000:]}"
            assert loop.time() < deadline, f"cluster not ready:\n{cluster.log_text()[-3000:]}"
            await asyncio.sleep(0.2)
        for name, pid, url in re.findall(r"worker (w\d+) pid=(\d+) url=(\S+)", cluster.log_text()):
            cluster.workers[name] = (int(pid), url)
        yield cluster
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        restarted = [int(pid) for pid in re.findall(r"worker w\d+ restarted pid=(\d+)", cluster.log_text())]
        for pid in [p for p, _ in cluster.workers.values()] + restarted:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _episode(agent: AsyncOpenAI, k: int, turns: int, messages: list[dict[str, Any]]) -> None:
    """`turns` more chat turns of the conversation `messages` (session-unique user messages)."""
    if not messages:
        messages.append({"role": "user", "content": f"Session {k}: fix the failing test."})
    for t in range(turns):
        resp = await agent.chat.completions.create(model="m", messages=messages, max_tokens=24,  # type: ignore[arg-type]
                                                   logprobs=True)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
        messages.append({"role": "user", "content": f"Session {k}, step {t}: go on."})


def _own_log(log: list[dict[str, Any]], token_ids: list[int]) -> list[dict[str, Any]]:
    """The engine requests of one session: those whose prompt is a prefix of its ids
    (prompts of different sessions differ in their first user message)."""
    return [r for r in log if token_ids[:len(r["input_ids"])] == r["input_ids"]]


async def _check_token_exact(http: httpx.AsyncClient, engine: str, sid: str, turns: int) -> None:
    traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
    branch = traj["branches"][0]
    assert len(branch["turns"]) == turns, sid
    log = (await http.get(f"{engine}/sim/requests")).json()
    assert_trajectory_matches_engine(branch, _own_log(log, branch["token_ids"]), sid)


@needs_haproxy
async def test_cluster_routes_by_instance_and_a_dead_worker_fails_only_its_sessions(
    tokenizer_dirs: dict[str, Path], tmp_path: Path,
) -> None:
    qwen3 = tokenizer_dirs["qwen3"]
    async with running_sim("sglang", str(qwen3), seed=5) as engine, \
            running_cluster(qwen3, engine, 3, tmp_path, "--no-restart") as cl, \
            httpx.AsyncClient(base_url=cl.url, timeout=60) as http:
        assert sorted(cl.workers) == ["w0", "w1", "w2"], cl.log_text()[-2000:]
        # a normal start: the workers that find their peers not up yet say so in one short
        # line each; no connection-error reprs, no access line per HAProxy health check
        start = cl.log_text()
        assert "ClientConnectorError" not in start and '"GET /health HTTP/1.0" 200' not in start, start[-3000:]
        assert max(len(line) for line in start.splitlines()) < 400, start[-3000:]
        # sessions created through the proxy land on several instances; base_url is the proxy's
        made = [(await http.post("/sessions", json={"metadata": {"k": k}})).json() for k in range(6)]
        by_instance: dict[str, list[dict[str, Any]]] = {}
        for s in made:
            assert s["base_url"] == f"{cl.url}/sessions/{s['session_id']}/v1"
            by_instance.setdefault(s["session_id"].split(".")[0], []).append(s)
        assert len(by_instance) >= 2, by_instance.keys()
        async with httpx.AsyncClient(timeout=30) as direct:
            for name, sessions in by_instance.items():  # each lives on its instance only
                for s in sessions:
                    url = cl.workers[name][1]
                    assert (await direct.get(f"{url}/sessions/{s['session_id']}")).status_code == 200
                    other = next(u for n, (_, u) in cl.workers.items() if n != name)
                    assert (await direct.get(f"{other}/sessions/{s['session_id']}")).status_code == 421

        # every turn of every session reaches its instance: multi-turn through the proxy
        agents = {s["session_id"]: AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
                  for s in made}
        talks: dict[str, list[dict[str, Any]]] = {sid: [] for sid in agents}
        await asyncio.gather(*(_episode(a, k, 3, talks[sid]) for k, (sid, a) in enumerate(agents.items())))
        for sid in agents:
            await _check_token_exact(http, engine, sid, 3)

        # kill one worker that holds sessions: only its sessions fail, with the clear error
        victim = next(n for n in ("w1", "w0", "w2") if n in by_instance)
        os.kill(cl.workers[victim][0], signal.SIGKILL)
        # the cluster reports it; by then HAProxy has seen its connections close (a request
        # sent in the same instant may meet a closed connection instead: docs/scale-out.md)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while f"worker {victim} exited" not in cl.log_text() and loop.time() < deadline:
            await asyncio.sleep(0.1)
        assert f"worker {victim} exited" in cl.log_text()
        for s in by_instance[victim]:
            with pytest.raises(openai.APIStatusError) as exc:
                await _episode(agents[s["session_id"]], 0, 1, talks[s["session_id"]])
            assert exc.value.status_code == 503
            err = exc.value.response.json()["error"]
            assert err["type"] == "instance_unavailable" and f"instance {victim} is down" in err["message"]
            r = await http.get(f"/sessions/{s['session_id']}/trajectory")
            assert r.status_code == 503 and victim in r.json()["error"]["message"]
        survivors = [s for n, ss in by_instance.items() if n != victim for s in ss]
        for s in survivors:
            await _episode(agents[s["session_id"]], 0, 1, talks[s["session_id"]])
            await _check_token_exact(http, engine, s["session_id"], 4)
        # new sessions only go to live instances
        fresh = [(await http.post("/sessions", json={})).json()["session_id"] for _ in range(4)]
        assert all(not sid.startswith(victim + ".") for sid in fresh), fresh
        # an id naming no instance of this cluster: a 404 from the proxy, in our envelope
        r = await http.get("/sessions/w9." + "0" * 32)
        assert r.status_code == 404 and r.json()["error"]["type"] == "session_not_found"
    # teardown stopped everything: the cluster says a worker died (status 1), no worker is left
    assert cl.proc.returncode == 1, cl.log_text()[-2000:]
    for pid, _ in cl.workers.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@needs_haproxy
async def test_errors_the_proxy_answers_itself_are_in_our_envelope(tmp_path: Path) -> None:
    """A worker that passes its health check but drops a request mid-way: the proxy's own
    502 is our JSON envelope on every route (a control request through the pool, a
    session's request naming its instance), never HAProxy's HTML page."""
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def drop(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.abort()  # a worker dying mid-request
        raise web.HTTPInternalServerError

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", drop)
    runner = web.AppRunner(app)
    await runner.setup()
    worker_port, proxy_port = free_ports(2)
    await web.TCPSite(runner, "127.0.0.1", worker_port).start()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config([WorkerSpec("w0", worker_port)], bind_host="127.0.0.1", port=proxy_port,
                                  directory=tmp_path))
    proc = await asyncio.create_subprocess_exec("haproxy", "-f", str(cfg), "-db", stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
    try:
        # a new client connection per request: HAProxy answers a request that was sent on a
        # reused server connection by closing, so that the client retries (docs/scale-out.md)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy_port}", timeout=10,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while True:  # until HAProxy is up and has seen w0 healthy (rise 2)
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/health")).status_code == 200:
                        break
                assert loop.time() < deadline
                await asyncio.sleep(0.2)
            r = await http.post("/control/pause", json={})
            assert r.status_code == 502 and r.headers["content-type"] == "application/json", r.text
            assert r.json()["error"]["type"] == "instance_unavailable"
            r = await http.get("/sessions/w0." + "0" * 32)
            assert r.status_code == 502 and "instance w0 failed" in r.json()["error"]["message"], r.text
    finally:
        proc.terminate()
        await proc.wait()
        await runner.cleanup()
