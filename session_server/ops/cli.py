"""`session-server serve | cluster | sim-engine | verify-template | demo`."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ..settings import ENV_PREFIX
from .settings_flags import add_settings_flags, settings_from_args, settings_or_report

__all__ = ["build_parser", "load_tokenizer", "main", "settings_from_args"]

HUB_PROBE_TIMEOUT_S = 3.0
JOURNAL_ENV = f"{ENV_PREFIX}JOURNAL_DIR"
DEFAULT_CLUSTER_JOURNAL = "session-journal"  # under the working directory, unless named
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process SIGPIPE ended


class TokenizerUnavailable(Exception):
    """`--tokenizer` names nothing loadable; the message says what to pass instead."""


def _builtin_names() -> tuple[str, ...]:
    from ..sim.tokenizers import FAMILIES

    return FAMILIES


def _hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """One bounded TCP connect to the hub (or to the HTTPS proxy that would carry the
    request): offline, transformers otherwise spends ~50 s in timeouts and retries."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        return False
    target = urllib.request.getproxies().get("https") or hub.ENDPOINT
    url = urllib.parse.urlsplit(target if "//" in target else f"http://{target}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def load_tokenizer(spec: str) -> Any:
    """`--tokenizer`: a local directory, one of the simulator's built-in offline names
    (resolved exactly as `sim-engine` does, `cached_tokenizer_dir`), or a hub name.

    A hub name is tried from the local cache first; only when the hub is reachable is
    it fetched online, so an offline machine fails in seconds with one clear line."""
    from transformers import AutoTokenizer

    from ..sim.tokenizers import cached_tokenizer_dir

    builtin = _builtin_names()
    instead = f"pass a local tokenizer directory or a built-in offline name ({', '.join(builtin)})"
    if spec == "toy" and not Path(spec).exists():
        raise TokenizerUnavailable(
            "'toy' is the simulator's byte-level tokenizer for its own tests (sim-engine takes it): it has no "
            f"chat template, so there is nothing to serve or verify; {instead}, each with its model's real template")
    path_or_name = spec
    if not Path(spec).exists() and spec in builtin:
        path_or_name = str(cached_tokenizer_dir(spec))
    elif not Path(spec).exists() and spec.startswith(("/", "./", "../", "~")):
        raise TokenizerUnavailable(f"tokenizer directory {spec!r} does not exist; {instead}")
    try:
        if Path(path_or_name).exists():
            return AutoTokenizer.from_pretrained(path_or_name)
        try:
            return AutoTokenizer.from_pretrained(path_or_name, local_files_only=True)
        except OSError:
            if not _hub_reachable():
                raise TokenizerUnavailable(
                    f"tokenizer {spec!r} is not in the local cache and the model hub is unreachable; {instead}"
                ) from None
        return AutoTokenizer.from_pretrained(path_or_name)
    except (OSError, ValueError, ImportError) as exc:
        # ImportError: with tiktoken installed (a `renderers` dependency) transformers tries
        # converting an empty directory's slow tokenizer and asks for protobuf
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TokenizerUnavailable(f"cannot load tokenizer {spec!r} ({first}); {instead}") from None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Show every default, except `None` and an on/off switch's (those flags say in
    words what unset means; `--no-restart (default: True)` reads as the opposite)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        switch = isinstance(action.default, bool) and not isinstance(action, argparse.BooleanOptionalAction)
        if action.default is None or switch:
            return action.help
        return super()._get_help_string(action)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..app import AppConfig, create_app
    from ..engines.http import raise_nofile_limit
    from ..malloc_tuning import retain_large_blocks
    from .serving import uvicorn_options

    settings = settings_or_report(args, "serve")
    if settings is None:
        return 2
    if settings.otel_endpoint is not None:  # before loading anything: traces asked, the packages missing
        from ..tracing import TracingUnavailable, check_available

        try:
            check_available()
        except TracingUnavailable as exc:
            print(f"session-server serve: error: {exc}", file=sys.stderr)
            return 2
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizerUnavailable as exc:
        print(f"session-server serve: error: {exc}", file=sys.stderr)
        return 2
    raise_nofile_limit()
    # Pool threads run Python (render, validate, serialize) and hold the GIL; the
    # event loop waits up to one switch interval (5 ms by default) to get it back,
    # several times per request. A shorter interval keeps /health fast under load.
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    # Fewer, later cyclic-GC passes: the server allocates many short-lived objects per
    # request, and a young-generation pass every 700 allocations adds tail latency.
    gc.set_threshold(args.gc_gen0_threshold, 20, 20)
    retain_large_blocks(settings.malloc_retain_mb)  # the reply workers do the same (reply_worker.main)
    app = create_app(AppConfig(tokenizer=tokenizer, engines=args.engine, settings=settings))
    options = uvicorn_options(
        host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
    )
    from ..durability import EXIT_ON_FATAL

    EXIT_ON_FATAL[0] = True  # a journal that does not replay ends the process with status 65
    uvicorn.run(app, workers=1, **options)
    return 0


def _cluster(args: argparse.Namespace) -> int:
    """N `serve` workers behind HAProxy (cluster.py); the options it does not know are
    the workers' serve options, checked here by the serve parser before anything starts."""
    from .cluster import RESERVED_FLAGS, ClusterError, run_cluster

    serve_args = list(args.serve_args)
    if args.workers < 1:
        print("session-server cluster: error: --workers must be at least 1", file=sys.stderr)
        return 2
    taken = [a for a in serve_args if a.split("=", 1)[0] in RESERVED_FLAGS]
    if taken:
        print(f"session-server cluster: error: {', '.join(taken)}: the cluster sets these on each worker "
              "(use --host/--port for the proxy)", file=sys.stderr)
        return 2
    serve = build_parser().parse_args(["serve", *serve_args])  # exits 2 on a bad serve option
    settings = settings_or_report(serve, "cluster")
    if settings is None:
        return 2
    journal_dir = None
    if args.journal:
        journal_dir = str(Path(args.journal_dir or os.environ.get(JOURNAL_ENV) or DEFAULT_CLUSTER_JOURNAL).resolve())
    else:
        os.environ.pop(JOURNAL_ENV, None)  # the workers inherit this environment: none of them journals
    try:
        return run_cluster(serve_args, workers=args.workers, port=args.port, host=args.host, haproxy=args.haproxy,
                           start_timeout_s=args.start_timeout_s, drain_timeout_s=settings.drain_timeout_s + 5.0,
                           proxy_timeout_s=args.proxy_timeout_s, restart=args.restart,
                           restart_backoff_s=args.restart_backoff_s, journal_dir=journal_dir)
    except ClusterError as exc:
        print(f"session-server cluster: error: {exc}", file=sys.stderr)
        return 2


def _sim_engine(args: argparse.Namespace) -> int:
    from ..sim import run_sim_engine

    run_sim_engine(
        args.protocol,
        args.tokenizer,
        host=args.host,
        port=args.port,
        seed=args.seed,
        dp=args.dp,
        latency_ms=args.latency_ms,
        request_latency_ms=args.request_latency_ms,
        noncanonical=args.noncanonical,
        padding=args.padding,
        routed=_sim_routed(args),
        return_routed_experts=args.enable_return_routed_experts,
        incremental_streaming_output=args.incremental_streaming_output,
    )
    return 0


def _sim_routed(args: argparse.Namespace) -> Any:
    """The simulated MoE: the flags given (the rest from the default), else the served
    model's config.json, else the default (`sim.routed.model_spec`)."""
    from ..sim.routed import DEFAULT_ROUTED, RoutedSpec

    given = {"layers": args.routed_layers, "topk": args.routed_topk, "num_experts": args.routed_experts}
    if all(v is None for v in given.values()):
        return "model"
    return RoutedSpec(**{k: getattr(DEFAULT_ROUTED, k) if v is None else v for k, v in given.items()})


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from .demo import run_demo

    return asyncio.run(run_demo(out_dir=args.out, turns=args.turns, protocol=args.protocol, hold_s=args.hold_s))


def _verify_template(args: argparse.Namespace) -> int:
    """Check a chat template against our codec contract; exit 1 on a hard mismatch."""
    import json

    from trajectory.codec.verify import verify_template

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizerUnavailable as exc:
        print(f"session-server verify-template: error: {exc}", file=sys.stderr)
        return 2
    report = verify_template(tokenizer, family=args.family, thinking=args.thinking)
    if not args.engine:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) if args.json else report.format_text())
        return 0 if report.ok else 1
    import asyncio

    from .verify_engine import verify_engine

    engine = f"{args.protocol}={args.engine}" if args.protocol and "=" not in args.engine else args.engine
    live = asyncio.run(verify_engine(tokenizer, engine, family=args.family, thinking=args.thinking,
                                     max_tokens=args.engine_max_tokens))
    if args.json:
        out = {**report.to_dict(), "engine": live.to_dict(), "ok": report.ok and live.ok}
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        print("\n".join([report.format_text(), "", *live.format_lines(), "",
                         "engine: OK" if live.ok else "engine: FAILED"]))
    return 0 if report.ok and live.ok else 1


def _sim_epilog() -> str:
    from ..sim import FAULT_KINDS

    kinds = "\n".join(f"  {', '.join(FAULT_KINDS[i:i + 4])}" for i in range(0, len(FAULT_KINDS), 4))
    return (
        "fault injection (the next generate requests misbehave, in order):\n"
        '  POST   /sim/faults {"kind": KIND, "count": N}   queue N faults of KIND (count default 1)\n'
        "  DELETE /sim/faults                            drop every queued fault\n"
        "  GET    /sim/requests | DELETE /sim/requests    the request log (for tests)\n"
        '  GET    /sim/weight_version | POST {"version"}  the weight version replies report\n'
        f"kinds:\n{kinds}\n"
        "see docs/api.md for what each kind does\n\n"
        "what the simulated model says: reasoning, then calls of the tools the prompt offers (read\n"
        "from the rendered prompt, arguments for each required parameter), then a final answer;\n"
        "plain text when no tool is offered. To make a harness's own calls, script it:\n"
        '  POST /sim/script {"turns": [MESSAGE, ...], "session": SID}\n'
        "      turn k of that session plays MESSAGE k (the last repeats); MESSAGE is\n"
        '      {"content", "reasoning_content", "tool_calls": [{"name", "arguments": {...}}]};\n'
        '      {"turns": []} drops it. SID: the server\'s session id (the engine sees only\n'
        "      its digest, the x-tito-session header)\n"
        "  WITHOUT \"session\" THE SCRIPT IS ENGINE-WIDE: every later request of every session\n"
        "      with no script of its own plays it, until replaced or dropped"
    )


def _engine_spec(spec: str) -> str:
    """`--engine`: the address shape POST /engines checks, refused before anything starts."""
    from ..engines.admission_check import check_engine_spec

    try:
        return check_engine_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="session-server", description="TITO session server for agentic RL rollouts")
    sub = p.add_subparsers(dest="command", required=True)
    builtin = ", ".join(_builtin_names())

    s = sub.add_parser(
        "serve", help="run the session server", formatter_class=_HelpFormatter,
        description="Run the session server in front of one or more SGLang/vLLM engines. API: docs/api.md.",
    )
    s.add_argument("--engine", action="append", required=True, type=_engine_spec,
                   help="engine URL, sglang=URL or vllm=URL (repeatable; the protocol is probed when not given)")
    s.add_argument("--tokenizer", required=True,
                   help=f"the engine model's tokenizer: a local directory, a hub name (needs the hub or its "
                        f"local cache), or a built-in offline name for the simulator ({builtin})")
    s.add_argument("--host", default="127.0.0.1", help="address to bind")
    s.add_argument("--port", type=int, default=8000, help="port to bind")
    add_settings_flags(s)
    s.add_argument("--gc-gen0-threshold", type=int, default=20_000, help="gc.set_threshold(N, 20, 20)")
    s.add_argument("--log-level", default="info", help="uvicorn log level")
    s.add_argument("--switch-interval-ms", type=float, default=0.5, help="GIL switch interval")
    s.set_defaults(func=_serve)

    c = sub.add_parser(
        "cluster", help="run N serve processes behind HAProxy on this machine", formatter_class=_HelpFormatter,
        usage="session-server cluster --workers N --port P [serve options: --engine ... --tokenizer ... ...]",
        description="Start N `serve` workers on free 127.0.0.1 ports (instance ids w0..w{N-1}) and HAProxy (the "
                    "Debian package 'haproxy') in front: /sessions/{id}/... goes to the instance named by the id's "
                    "prefix, everything else (POST /sessions, /control/*, ...) to the least-loaded instance. Every "
                    "other option is passed to each worker's `serve`. See docs/scale-out.md.",
    )
    c.add_argument("--workers", type=int, default=2, help="serve processes to start")
    c.add_argument("--host", default="127.0.0.1", help="address HAProxy binds")
    c.add_argument("--port", type=int, default=8000, help="port HAProxy binds")
    c.add_argument("--haproxy", default=None, help="the haproxy executable (default: haproxy on PATH)")
    c.add_argument("--start-timeout-s", type=float, default=300.0, help="how long workers may take to become ready")
    c.add_argument("--proxy-timeout-s", type=int, default=3600,
                   help="HAProxy's client/server inactivity timeout (a turn may run for minutes)")
    c.add_argument("--no-restart", dest="restart", action="store_false",
                   help="leave a dead worker dead (default: restart it after a backoff; it joins the cluster's "
                        "pause state, weight version and engines from its peers before it takes traffic)")
    c.add_argument("--restart-backoff-s", type=float, default=1.0,
                   help="delay before a dead worker is restarted; doubles (up to 30 s) while it keeps dying within "
                        "a minute")
    c.add_argument("--journal-dir", default=None,
                   help="where the workers journal their sessions, one file per instance, so a worker that dies "
                        "comes back with them (default: $TITO_JOURNAL_DIR, else ./session-journal)")
    c.add_argument("--no-journal", dest="journal", action="store_false",
                   help="keep sessions in the workers' memory only: a worker that dies loses them")
    c.set_defaults(func=_cluster, serve_args=[])

    e = sub.add_parser(
        "sim-engine", help="run a simulated SGLang or vLLM engine (offline, with fault injection)",
        formatter_class=_HelpFormatter, epilog=_sim_epilog(),
        description="A wire-faithful simulated engine for tests, benchmarks and trying the server offline.",
    )
    e.add_argument("--protocol", choices=("sglang", "vllm"), required=True, help="which engine's HTTP API to speak")
    e.add_argument("--tokenizer", required=True,
                   help=f"'toy', a built-in offline name ({builtin}), a tokenizer directory or a hub name")
    e.add_argument("--host", default="127.0.0.1", help="address to bind")
    e.add_argument("--port", type=int, default=30000, help="port to bind")
    e.add_argument("--seed", type=int, default=0, help="sampling seed")
    e.add_argument("--dp", type=int, default=1, help="data-parallel ranks to simulate")
    e.add_argument("--latency-ms", type=float, default=0.0, help="latency per sampled token")
    e.add_argument("--request-latency-ms", type=float, default=0.0, help="fixed latency per request")
    e.add_argument("--noncanonical", action="store_true", help="emit non-canonical segmentations")
    e.add_argument("--incremental-streaming-output", action="store_true",
                   help="SGLang: stream frames hold only the new tokens and text (SGLang's server flag)")
    e.add_argument("--padding", choices=("base64", "floats"), default=None,
                   help="add a routed-experts-like payload to every reply (default: none)")
    e.add_argument("--routed-layers", type=int, default=None,
                   help="routing replay: MoE layers of the simulated model (default: the model's config.json "
                   "num_hidden_layers, as SGLang reads it, else 4)")
    e.add_argument("--routed-topk", type=int, default=None,
                   help="routing replay: experts per token (default: config.json num_experts_per_tok, else 2)")
    e.add_argument("--routed-experts", type=int, default=None,
                   help="routing replay: experts per layer (default: config.json num_experts, else 16)")
    e.add_argument("--enable-return-routed-experts", action="store_true",
                   help="vLLM: every answer carries its routed experts (vLLM's server flag; SGLang answers "
                        "when a request asks)")
    e.set_defaults(func=_sim_engine)

    v = sub.add_parser(
        "verify-template", help="check a tokenizer's chat template against the TITO codec contract",
        formatter_class=_HelpFormatter,
        description="Play probe conversations (user, tool, parallel-tool, system and injected assistant "
                    "appends; reasoning on/off; unicode; JSON true/false/null) through our codec and "
                    "compare every bridged step with the template's own full render. Exit 1 on a hard "
                    "mismatch (bridge != full render on an append-only step, or a parse round-trip "
                    "failure), 0 otherwise, 2 when the tokenizer cannot be loaded.",
    )
    v.add_argument("--tokenizer", required=True,
                   help=f"a local tokenizer directory, a hub name, or a built-in offline name ({builtin})")
    v.add_argument("--family", default=None, help="force a chat-template family (default: detected from the template)")
    v.add_argument("--thinking", choices=("on", "off", "both"), default="both",
                   help="reasoning modes to check (enable_thinking), where the template has the switch")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.add_argument("--engine", default=None,
                   help="engine URL (or sglang=URL / vllm=URL) serving this tokenizer's model: also drive it "
                        "through the server and check every turn is token-exact with what the engine saw and "
                        "sampled (a GPU check)")
    v.add_argument("--protocol", choices=("sglang", "vllm"), default=None,
                   help="the engine's protocol (default: probed)")
    v.add_argument("--engine-max-tokens", type=int, default=256, help="max_tokens per engine turn")
    v.set_defaults(func=_verify_template)

    d = sub.add_parser("demo", help="sim engines + server + an openai-client agent, offline", formatter_class=_HelpFormatter)
    d.add_argument("--out", default="demo_output", help="directory for the exported trajectory")
    d.add_argument("--turns", type=int, default=8, help="agent turns")
    d.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang", help="simulated engine protocol")
    d.add_argument("--hold-s", type=float, default=0.0, help="keep the server up this long after the episode, to "
                   "look at the session in the viewer (its URL is printed)")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    # transformers advises installing PyTorch on import; this CLI only needs tokenizers
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "cluster":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "cluster":
        args.serve_args = rest
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # the reader went away (`verify-template --json | head`): stop quietly, as a
        # Unix tool does, with the status a death by SIGPIPE gives; the interpreter's
        # final flush of stdout would fail again, so it goes to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
