"""`session-server cluster`: N `serve` processes behind HAProxy on one machine.

Why HAProxy and not a proxy of our own: users scale with parts they already run, and
a session's requests must reach the one process that holds it in memory. Every
session id starts with its instance id (`w3.<32 hex>`, sessions.py), so routing is a
stateless rule on the path that any proxy can apply: `/sessions/{instance}.…` goes
to that instance, everything else (`POST /sessions`, `/health`, `/v1/models`,
`/control/*`, `/engines`, `/samples`) to the least-loaded live instance
(`balance leastconn`). The same rule, written for HAProxy, Envoy or a Kubernetes
ingress, runs a cluster over several machines (docs/scale-out.md).

This module only generates the HAProxy config and supervises the children: the
workers are plain `serve` processes (each told its `--instance-id` and its
`--peers`), HAProxy runs in the foreground (`-db`) with a config in a temp dir.
A worker that dies is logged and left dead (its sessions lived in its memory):
HAProxy's health check marks it down and its sessions' requests get a 503
`instance_unavailable` naming it, in our error envelope, while the other workers
keep serving. SIGTERM/SIGINT stop HAProxy (soft: it finishes open requests) and
every worker (each drains its turns), then kill what is left.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from ..control.relay import RELAYED_HEADER
from ..engines.http import raise_nofile_limit
from ..journal import JOURNAL_EXIT_STATUS
from ..parent_death import die_with_parent_argv
from ..sessions import ID_SEPARATOR

__all__ = ["ClusterError", "HaproxyMissing", "WorkerSpec", "haproxy_config", "find_haproxy", "run_cluster"]

_log = logging.getLogger("session_server.ops.cluster")

HAPROXY_PACKAGE = "haproxy"
POLL_S = 0.2
RESTART_CAP_S = 30.0  # the restart delay doubles per death of a worker that ran < RESTART_RESET_S, up to this
RESTART_RESET_S = 60.0
# flags the cluster sets on every worker itself; given among the serve options they are an error
RESERVED_FLAGS = ("--host", "--port", "--instance-id", "--peers")


class ClusterError(Exception):
    """The cluster cannot start or lost a part it cannot run without; the message says which."""


class HaproxyMissing(ClusterError):
    """No `haproxy` executable: the message names the Debian package."""


@dataclass(frozen=True)
class WorkerSpec:
    """One `serve` process of the cluster."""

    instance: str
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def find_haproxy(explicit: str | None = None) -> str:
    """The haproxy executable, or HaproxyMissing saying how to install it."""
    found = shutil.which(explicit or "haproxy")
    if found is None:
        raise HaproxyMissing(
            f"{explicit or 'haproxy'!r} is not on PATH: `session-server cluster` runs HAProxy in front of its "
            f"workers; install the Debian/Ubuntu package '{HAPROXY_PACKAGE}' (apt-get install {HAPROXY_PACKAGE}) "
            "or pass --haproxy PATH")
    return found


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _error_response(status: int, reason: str, kind: str, message: str) -> str:
    """An HAProxy errorfile: a whole HTTP response whose body is our error envelope."""
    body = json.dumps({"error": {"type": kind, "message": message}})
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nCache-Control: no-cache\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}")


# errors HAProxy answers itself once a request is parsed (a worker failing mid-request,
# none up, a timeout), in our envelope on every route: status -> (reason, type, message).
# A request HAProxy cannot parse at all gets its built-in 400 page (its HTTP/1 layer
# answers that before any errorfile applies).
PROXY_ERRORS = {
    400: ("Bad Request", "bad_request", "the proxy could not parse the request"),
    408: ("Request Timeout", "request_timeout", "the request was not received in time"),
    500: ("Internal Server Error", "proxy_error", "the proxy failed on this request"),
    502: ("Bad Gateway", "instance_unavailable", "the instance failed during the request (did it die?)"),
    503: ("Service Unavailable", "instance_unavailable", "no instance of this cluster is up"),
    504: ("Gateway Timeout", "instance_timeout", "the instance did not answer within the proxy's timeout"),
}


def write_error_files(directory: Path, workers: Sequence[WorkerSpec]) -> None:
    """Our-envelope errorfiles: the proxy's defaults (`PROXY_ERRORS`) and one 502/503/504
    per instance backend naming the instance."""
    for code, (reason, kind, message) in PROXY_ERRORS.items():
        (directory / f"{code}_proxy.http").write_text(_error_response(code, reason, kind, message))
    for w in workers:
        down = (f"session instance {w.instance} is down or not answering its health check (restarting, or "
                "replaying its journal: retry; without a journal, a session of an instance that died is lost)")
        (directory / f"503_{w.instance}.http").write_text(
            _error_response(503, "Service Unavailable", "instance_unavailable", down))
        (directory / f"502_{w.instance}.http").write_text(_error_response(
            502, "Bad Gateway", "instance_unavailable",
            f"session instance {w.instance} failed during the request (did it die?)"))
        (directory / f"504_{w.instance}.http").write_text(_error_response(
            504, "Gateway Timeout", "instance_timeout",
            f"session instance {w.instance} did not answer within the proxy's timeout"))


def haproxy_config(
    workers: Sequence[WorkerSpec], *, bind_host: str, port: int, directory: Path, timeout_s: int = 3600,
) -> str:
    """The HAProxy config: route by the session id's instance prefix, else least-loaded.

    The instance is the third path field up to the first `.` (`/sessions/w3.abc…/v1/…`),
    looked up in a map file (one line per instance: O(log N), robust for any N);
    an unknown or missing prefix is a 404 in our envelope from HAProxy itself.
    Each instance backend is health-checked on `/health`; the pool's servers track
    those checks. `retry-on conn-failure` only retries what never reached a worker,
    so a turn is never sent twice. Timeouts are long: a turn may run for minutes."""
    instance_map = directory / "instances.map"
    instance_map.write_text("".join(f"{w.instance} be_{w.instance}\n" for w in workers))
    write_error_files(directory, workers)
    lines = [
        "global",  # maxconn unset: HAProxy derives it from the file-descriptor limit
        "",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        f"    timeout client {timeout_s}s",
        f"    timeout server {timeout_s}s",
        "    timeout http-request 300s",
        "    timeout http-keep-alive 75s",
        "    timeout queue 60s",
        "    timeout check 5s",  # a loaded worker's /health may take a while: not the inter (1 s)
        "    retries 2",
        "    retry-on conn-failure",
        *(f"    errorfile {code} {directory / f'{code}_proxy.http'}" for code in PROXY_ERRORS),
        "",
        "frontend tito",
        f"    bind {bind_host}:{port}",
        "    option forwardfor",
        f"    http-request del-header {RELAYED_HEADER}",  # only instances mark relays; a client's would misfire
        "    acl session_path path_beg /sessions/",
        "    http-request set-var(txn.sid) path,field(3,/) if session_path",
        f"    http-request set-var(txn.instance) var(txn.sid),field(1,{ID_SEPARATOR}) if session_path",
        f"    use_backend %[var(txn.instance),map_str({instance_map},be_unknown_instance)] if session_path",
        "    default_backend be_pool",
        "",
        "backend be_pool",
        "    balance leastconn",
        "    option redispatch",
        *(f"    server {w.instance} {w.host}:{w.port} track be_{w.instance}/{w.instance}" for w in workers),
        "",
        "backend be_unknown_instance",
        "    http-request return status 404 content-type application/json lf-string "
        "'{\"error\":{\"type\":\"session_not_found\",\"message\":\"session "
        "%[var(txn.sid),json(utf8s)] names no instance of this cluster (session ids are {instance}."
        f"{{32 hex}}; instances: {_names(workers)})\"}}}}'",
    ]
    for w in workers:
        lines += [
            "",
            f"backend be_{w.instance}",
            "    option httpchk GET /health",
            "    http-check expect status 200",
            *(f"    errorfile {code} {directory / f'{code}_{w.instance}.http'}" for code in (502, 503, 504)),
            f"    server {w.instance} {w.host}:{w.port} check inter 1s fall 3 rise 2",
        ]
    return "\n".join(lines) + "\n"


def _names(workers: Sequence[WorkerSpec]) -> str:
    names = [w.instance for w in workers]
    return ", ".join(names) if len(names) <= 4 else f"{names[0]} .. {names[-1]}"


def worker_argv(w: WorkerSpec, peers: Sequence[WorkerSpec], serve_args: Sequence[str]) -> list[str]:
    """The `serve` command line of one worker: the user's serve options plus its identity."""
    argv = [sys.executable, "-m", "session_server.ops.cli", "serve", *serve_args,
            "--host", w.host, "--port", str(w.port), "--instance-id", w.instance]
    for p in peers:
        if p.instance != w.instance:
            argv += ["--peers", p.url]
    return argv


def _healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return int(r.status) == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


@dataclass
class _Children:
    """The processes this cluster started, and what it already reported."""

    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    haproxy: subprocess.Popen[bytes] | None = None
    reported: set[str] = field(default_factory=set)  # dead and not (yet) restarted
    deaths: int = 0
    started_at: dict[str, float] = field(default_factory=dict)  # monotonic, per instance
    restart_at: dict[str, float] = field(default_factory=dict)  # monotonic, for dead instances
    backoff_s: dict[str, float] = field(default_factory=dict)
    first_backoff_s: float = 1.0

    def start(self, w: WorkerSpec, argv: list[str]) -> subprocess.Popen[bytes]:
        # dies with the cluster, even by `kill -9` (parent_death.py)
        self.workers[w.instance] = p = subprocess.Popen(die_with_parent_argv(argv), stdin=subprocess.DEVNULL)
        self.started_at[w.instance] = time.monotonic()
        self.reported.discard(w.instance)
        return p

    def schedule_restart(self, name: str) -> float:
        """When to restart `name`: after a delay that doubles while it keeps dying young."""
        ran = time.monotonic() - self.started_at.get(name, 0.0)
        prev = self.backoff_s.get(name)
        first = self.first_backoff_s
        delay = first if prev is None or ran >= RESTART_RESET_S else min(max(first, RESTART_CAP_S), prev * 2)
        self.backoff_s[name] = delay
        self.restart_at[name] = time.monotonic() + delay
        return delay

    def stop(self, drain_s: float) -> None:
        """HAProxy soft-stops (finishes open requests) while the workers drain their
        turns (SIGTERM); after `drain_s` whatever is left is killed."""
        procs = list(self.workers.values())
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.send_signal(signal.SIGUSR1)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + drain_s
        for p in procs:
            _wait_or_kill(p, deadline)
        if self.haproxy is not None:
            if self.haproxy.poll() is None:
                self.haproxy.terminate()
            _wait_or_kill(self.haproxy, time.monotonic() + 5.0)

    def newly_dead(self) -> list[tuple[str, int]]:
        """Workers that exited since the last call: (instance, exit status)."""
        out = []
        for name, p in self.workers.items():
            rc = p.poll()
            if rc is not None and name not in self.reported:
                self.reported.add(name)
                self.deaths += 1
                out.append((name, rc))
        return out


def _wait_or_kill(p: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _wait_ready(children: _Children, specs: Sequence[WorkerSpec], timeout_s: float, stop: threading.Event) -> None:
    """Until every worker answers /health; a worker that exits first fails the start."""
    deadline = time.monotonic() + timeout_s
    pending = {w.instance: w for w in specs}
    while pending:
        for name, w in list(pending.items()):
            rc = children.workers[name].poll()
            if rc is not None:
                raise ClusterError(f"worker {name} exited with status {rc} before it was ready (see its log above)")
            if _healthy(w.url):
                del pending[name]
        if stop.is_set():
            raise ClusterError("stopped before the cluster was ready")
        if pending and time.monotonic() > deadline:
            raise ClusterError(f"workers {', '.join(sorted(pending))} not ready after {timeout_s:.0f} s")
        if pending:
            time.sleep(POLL_S)


def run_cluster(
    serve_args: Sequence[str], *, workers: int, port: int, host: str = "127.0.0.1", haproxy: str | None = None,
    start_timeout_s: float = 300.0, drain_timeout_s: float = 30.0, proxy_timeout_s: int = 3600,
    restart: bool = True, restart_backoff_s: float = 1.0, journal_dir: str | None = None,
) -> int:
    """Start the workers and HAProxy, supervise them until SIGTERM/SIGINT or HAProxy's
    death; exit status 0 when stopped with no worker ever dead, 1 otherwise.

    `restart`: a dead worker is started again (same instance id and port) after
    `restart_backoff_s`, doubling while it keeps dying within a minute; it joins the cluster's control state from its peers before it reports
    healthy (control/peer_sync.py), so HAProxy sends it nothing stale.

    `journal_dir`: every worker journals its sessions there (`{instance}.sqlite3`), so
    a restarted worker replays them before it reports healthy and its agents go on; a
    worker whose journal does not replay (exit status 65) is not restarted. None: its
    sessions are lost with it (they lived in its memory)."""
    haproxy_bin = find_haproxy(haproxy)  # before anything starts
    soft, _ = raise_nofile_limit()  # inherited by HAProxy and the workers
    _log.info("cluster: file-descriptor limit %d", soft)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        _log.info("cluster: %s received, stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    specs = [WorkerSpec(f"w{i}", p) for i, p in enumerate(free_ports(workers))]
    if journal_dir is not None:
        serve_args = [*serve_args, "--journal-dir", journal_dir]
        _log.info("cluster: sessions journaled in %s (one file per instance)", journal_dir)
    children = _Children(first_backoff_s=restart_backoff_s)
    directory = Path(tempfile.mkdtemp(prefix="tito-cluster-"))
    try:
        for w in specs:
            proc = children.start(w, worker_argv(w, specs, serve_args))
            _log.info("cluster: worker %s pid=%d url=%s", w.instance, proc.pid, w.url)
        _wait_ready(children, specs, start_timeout_s, stop)
        cfg = directory / "haproxy.cfg"
        cfg.write_text(haproxy_config(specs, bind_host=host, port=port, directory=directory, timeout_s=proxy_timeout_s))
        children.haproxy = subprocess.Popen(die_with_parent_argv([haproxy_bin, "-f", str(cfg), "-db"]),
                                            stdin=subprocess.DEVNULL)
        shown = f"[{host}]" if ":" in host else host  # an IPv6 literal
        _wait_proxy(children.haproxy, f"http://{shown}:{port}", stop)
        _log.info("cluster ready: http://%s:%d (%d workers, haproxy pid=%d, config %s)",
                  shown, port, len(specs), children.haproxy.pid, cfg)
        restarter = (lambda w: children.start(w, worker_argv(w, specs, serve_args))) if restart else None
        return _supervise(children, stop, {w.instance: w for w in specs}, restarter, durable=journal_dir is not None)
    except ClusterError as exc:
        _log.error("cluster: %s", exc)
        return 1
    finally:
        children.stop(drain_timeout_s)
        shutil.rmtree(directory, ignore_errors=True)
        for s, h in previous.items():
            signal.signal(s, h)
        _log.info("cluster: stopped")


def _wait_proxy(proc: subprocess.Popen[bytes], url: str, stop: threading.Event, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if proc.poll() is not None:
            raise ClusterError(f"haproxy exited with status {proc.returncode} at start (see its log above)")
        if stop.is_set():
            raise ClusterError("stopped before the cluster was ready")
        if time.monotonic() > deadline:
            raise ClusterError(f"haproxy did not answer on {url} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _supervise(
    children: _Children, stop: threading.Event, specs: dict[str, WorkerSpec],
    restarter: Callable[[WorkerSpec], subprocess.Popen[bytes]] | None, *, durable: bool = False,
) -> int:
    """Report (and restart, with `restarter`) dead workers; end on a stop signal,
    HAProxy's exit, or, without restarts, the last worker's."""
    assert children.haproxy is not None
    while not stop.wait(POLL_S):
        for name, rc in children.newly_dead():
            fate = ("its sessions wait in its journal" if durable else
                    "its sessions are lost (they lived in its memory)")
            if rc == JOURNAL_EXIT_STATUS:
                _log.error("cluster: worker %s stopped: its journal does not replay (see its log); not restarted "
                           "until that file is restored or moved away; the other workers keep serving", name)
            elif restarter is None:
                _log.error("cluster: worker %s exited with status %d: %s and answer 503 "
                           "instance_unavailable at the proxy; the other workers keep serving", name, rc, fate)
            else:
                delay = children.schedule_restart(name)
                _log.error("cluster: worker %s exited with status %d: %s (503 instance_unavailable at the proxy "
                           "until it is back); restarting it in %.0f s", name, rc, fate, delay)
        if restarter is not None:
            now = time.monotonic()
            for name, when in list(children.restart_at.items()):
                if now >= when:
                    del children.restart_at[name]
                    try:
                        proc = restarter(specs[name])
                    except OSError as exc:  # e.g. out of processes: try again later
                        delay = children.schedule_restart(name)
                        _log.error("cluster: restarting worker %s failed (%s); again in %.0f s", name, exc, delay)
                        continue
                    _log.info("cluster: worker %s restarted pid=%d url=%s", name, proc.pid, specs[name].url)
        if children.haproxy.poll() is not None:
            _log.error("cluster: haproxy exited with status %d; stopping the workers", children.haproxy.returncode)
            return 1
        if restarter is None and len(children.reported) == len(children.workers):
            _log.error("cluster: every worker has exited; stopping")
            return 1
    return 1 if children.deaths else 0  # a worker that died before the stop signal
