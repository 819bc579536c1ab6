"""`session-server serve | sim-engine | demo`."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from .context import Settings
from .offload import default_cpu_workers
from .routing.factory import POLICY_NAMES


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import AppConfig, create_app
    from .engines.http import raise_nofile_limit

    raise_nofile_limit()
    # Pool threads run Python (render, validate, serialize) and hold the GIL; the
    # event loop waits up to one switch interval (5 ms by default) to get it back,
    # several times per request. A shorter interval keeps /health fast under load.
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    # Fewer, later cyclic-GC passes: the server allocates many short-lived objects per
    # request, and a young-generation pass every 700 allocations adds tail latency.
    gc.set_threshold(args.gc_gen0_threshold, 20, 20)
    settings = Settings(
        cpu_workers=args.cpu_workers,
        default_max_tokens=args.default_max_tokens,
        turn_timeout_s=args.turn_timeout_s,
        max_body_bytes=args.max_body_mb * 1024 * 1024,
        max_sessions=args.max_sessions,
        default_ttl_s=args.ttl_s,
        routing_policy=args.routing_policy,
        prefill_slots_per_engine=args.prefill_slots,
        large_prefill_tokens=args.large_prefill_tokens,
        decode_processes=args.decode_processes,
    )
    app = create_app(AppConfig(tokenizer=args.tokenizer, engines=args.engine, settings=settings, family=args.family))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        workers=1,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        backlog=4096,
    )
    return 0


def _sim_engine(args: argparse.Namespace) -> int:
    from .sim import run_sim_engine

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
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from .demo import run_demo

    return asyncio.run(run_demo(out_dir=args.out, turns=args.turns, protocol=args.protocol))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="session-server", description="TITO session server for agentic RL rollouts")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the session server")
    s.add_argument("--engine", action="append", required=True, help="URL, sglang=URL or vllm=URL (repeatable)")
    s.add_argument("--tokenizer", required=True, help="path or name for AutoTokenizer.from_pretrained")
    s.add_argument("--family", default=None, help="force a chat-template family (default: detect)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--cpu-workers", type=int, default=default_cpu_workers())
    s.add_argument("--default-max-tokens", type=int, default=1024)
    s.add_argument("--turn-timeout-s", type=float, default=600.0)
    s.add_argument("--max-body-mb", type=int, default=32)
    s.add_argument("--max-sessions", type=int, default=100_000)
    s.add_argument("--ttl-s", type=float, default=3600.0)
    s.add_argument("--routing-policy", default="sticky_cost", choices=POLICY_NAMES)
    s.add_argument("--prefill-slots", type=int, default=1, help="large uncached prefills in flight per engine")
    s.add_argument("--large-prefill-tokens", type=int, default=16384)
    s.add_argument("--decode-processes", type=int, default=1, help="processes decoding large engine replies")
    s.add_argument("--gc-gen0-threshold", type=int, default=20_000, help="gc.set_threshold(N, 20, 20)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--switch-interval-ms", type=float, default=0.5, help="GIL switch interval")
    s.set_defaults(func=_serve)

    e = sub.add_parser("sim-engine", help="run a simulated SGLang or vLLM engine")
    e.add_argument("--protocol", choices=("sglang", "vllm"), required=True)
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=30000)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--dp", type=int, default=1)
    e.add_argument("--latency-ms", type=float, default=0.0, help="latency per sampled token")
    e.add_argument("--request-latency-ms", type=float, default=0.0, help="fixed latency per request")
    e.add_argument("--noncanonical", action="store_true", help="emit non-canonical segmentations")
    e.add_argument("--padding", choices=("base64", "floats"), default=None, help="routed-experts-like payload")
    e.set_defaults(func=_sim_engine)

    d = sub.add_parser("demo", help="sim engines + server + an openai-client agent, offline")
    d.add_argument("--out", default="demo_output")
    d.add_argument("--turns", type=int, default=8)
    d.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
