"""CPU per turn with OpenTelemetry traces off against on, alternating in one run.

Each leg is one `turn_cost.py` run (a fresh simulated engine and `serve`, warm-up turns,
then `--turns` measured turns per agent, the server's CPU from /proc): `off` as the
server runs by default, `on` with `--otel-endpoint` set to a local OTLP/HTTP sink that
this process runs (it answers every POST /v1/traces and counts what it got; its CPU is
not the server's, as a collector is another machine). The legs run in ABBA order (off,
on, on, off, ...) so a drift of the shared machine's load falls on both sides alike;
the JSON holds every leg, each side's median and the per-round differences (on - off).

    python bench/traces.py --agents 16 --turns 6 --rounds 2 --json bench/results/traces.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.alternate import abba_order  # noqa: E402
from bench.turn_cost import one_run  # noqa: E402
from session_server.ops.harness import free_port  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


class Sink:
    """A local OTLP/HTTP traces receiver on its own thread and loop: counts POSTs and bytes."""

    def __init__(self) -> None:
        self.posts = 0
        self.bytes = 0
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-sink", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def traces(request: web.Request) -> web.Response:
            self.bytes += len(await request.read())
            self.posts += 1
            return web.Response(body=b"", content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> Sink:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--protocol", default="sglang", choices=("sglang", "vllm"))
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="runs per side, in ABBA order")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tokenizer = str(cached_tokenizer_dir(args.family))
    legs: list[dict[str, Any]] = []
    with Sink() as sink:
        for slot, side in enumerate(abba_order(args.rounds)):
            side = "off" if side == "old" else "on"
            server_args = [] if side == "off" else [f"--otel-endpoint=http://127.0.0.1:{sink.port}"]
            posts0, bytes0 = sink.posts, sink.bytes
            run = one_run(tokenizer, args.protocol, args.agents, args.warmup, args.turns, args.max_tokens,
                          [], server_args)
            run.update(side=side, slot=slot, otlp_posts=sink.posts - posts0, otlp_bytes=sink.bytes - bytes0)
            print(json.dumps(run), file=sys.stderr, flush=True)
            legs.append(run)
    by_side = {s: [r for r in legs if r["side"] == s] for s in ("off", "on")}
    cpu = {s: statistics.median(r["cpu_ms_per_turn"] for r in rs) for s, rs in by_side.items()}
    pairs = list(zip(by_side["off"], by_side["on"], strict=True))
    result = {
        "family": args.family, "protocol": args.protocol, "agents": args.agents, "warmup": args.warmup,
        "turns_per_agent": args.turns, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "order": [r["side"] for r in legs], "legs": legs,
        "median_cpu_ms_per_turn": cpu,
        "on_minus_off_ms_per_turn": round(cpu["on"] - cpu["off"], 3),
        "per_round_on_minus_off_ms": [round(b["cpu_ms_per_turn"] - a["cpu_ms_per_turn"], 3) for a, b in pairs],
        "median_turns_per_s": {s: statistics.median(r["turns_per_s"] for r in rs) for s, rs in by_side.items()},
        "spans_exported": any(r["otlp_posts"] for r in by_side["on"]),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
