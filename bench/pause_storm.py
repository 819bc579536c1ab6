"""Pause storm: do turns survive many abort-mode pauses with exactly the uninterrupted tokens?

Workload: one simulated engine (its own process, per-token latency) and N
concurrent sessions (default 200), each running `--turns` turns in sequence
(turn k+1's prompt = turn k's context + its sampled ids + a new user message),
every turn through `session_server.control.generate_resilient`. First a
reference run with no pauses, then the same workload while a storm task runs
`--cycles` pause("abort") / resume cycles spread over the reference run's
duration. Each storm turn is compared with its reference turn.

Reports lost turns (raised), 5xx (errors the server would answer with >= 500),
truncated turns (finish `length` where the reference stopped), token or logprob
mismatches, aborts, empty aborts, resubmits and time waiting at the gate. Exits
non-zero unless lost, truncated and mismatched are all zero.

    python bench/pause_storm.py --json bench/results/pause_storm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._procs import sim_engine  # noqa: E402
from session_server.control import ControlPlane, generate_resilient  # noqa: E402
from session_server.engines import GenerateRequest, SGLangAdapter, VLLMAdapter  # noqa: E402
from session_server.errors import ServiceError  # noqa: E402
from session_server.sim.tokenizers import cached_tokenizer_dir  # noqa: E402


def _encoder(family: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cached_tokenizer_dir(family)))

    def user_turn(text: str) -> list[int]:
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tok.encode(rendered, add_special_tokens=False))

    return user_turn


async def _session(
    i: int, adapter: Any, control: ControlPlane, user_turn: Any, turns: int, max_tokens: int,
    out: dict[tuple[int, int], dict[str, Any]],
) -> None:
    context = user_turn(f"session {i}: inspect the repository and fix the failing test")
    for k in range(turns):
        req = GenerateRequest(f"{i:016x}{k:016x}", context, max_tokens, timeout_s=120.0)
        t0 = time.monotonic()
        try:
            r = await generate_resilient(adapter, req, control)
        except Exception as exc:  # noqa: BLE001 - every failure is a lost turn, counted by kind
            status = exc.status if isinstance(exc, ServiceError) else 500
            out[(i, k)] = {"error": f"{type(exc).__name__}: {exc}", "status": status}
            return  # the session cannot continue without its turn
        out[(i, k)] = {
            "ids": [int(t) for t in r.output_ids],
            "logprobs": [float(x) for x in r.logprobs],
            "finish": r.finish_reason,
            "aborts": r.aborts,
            "empty_aborts": r.empty_aborts,
            "resubmits": r.resubmits,
            "paused_wait_s": r.paused_wait_s,
            "latency_s": time.monotonic() - t0,
        }
        context = context + out[(i, k)]["ids"] + user_turn(f"tool result {k} for session {i}")


async def _run(
    url: str, protocol: str, user_turn: Any, sessions: int, turns: int, max_tokens: int,
    storm: dict[str, Any] | None,
) -> tuple[dict[tuple[int, int], dict[str, Any]], dict[str, Any]]:
    adapter = (SGLangAdapter if protocol == "sglang" else VLLMAdapter)(url, max_concurrency=sessions + 8)
    control = ControlPlane(lambda: [adapter], grace_s=storm["grace_s"] if storm else 0.05)
    out: dict[tuple[int, int], dict[str, Any]] = {}
    cycles: list[dict[str, Any]] = []
    done = asyncio.Event()

    async def stormer() -> None:
        assert storm is not None
        for _ in range(storm["cycles"]):
            await asyncio.sleep(storm["interval_s"])
            if done.is_set():
                break
            t0 = time.monotonic()
            in_flight = len(control.in_flight())  # segments at the engine when the gate closes
            report = await control.pause("abort")
            await asyncio.sleep(storm["hold_s"])
            resumed = await control.resume()
            cycles.append({
                "pause_ok": report["ok"], "resume_ok": resumed["ok"],
                "in_flight_at_pause": in_flight, "paused_s": time.monotonic() - t0,
                "waiting_at_resume": control.state()["waiting_at_gate"],
            })

    t0 = time.monotonic()
    try:
        storm_task = asyncio.create_task(stormer()) if storm else None
        await asyncio.gather(*(
            _session(i, adapter, control, user_turn, turns, max_tokens, out) for i in range(sessions)
        ))
        wall = time.monotonic() - t0
        done.set()
        if storm_task is not None:
            await storm_task
    finally:
        await adapter.aclose()
    return out, {"wall_s": wall, "cycles": cycles, "control": control.state()["counters"]}


def _compare(ref: dict[tuple[int, int], dict[str, Any]], got: dict[tuple[int, int], dict[str, Any]],
             expected_turns: int) -> dict[str, Any]:
    lost = [k for k in ref if k not in got or "error" in got[k]]
    errors = [got[k] for k in got if "error" in got[k]]
    ok = [k for k in ref if k in got and "error" not in got[k]]
    truncated = [k for k in ok if got[k]["finish"] == "length" and ref[k]["finish"] != "length"]
    mismatched = [
        k for k in ok
        if got[k]["ids"] != ref[k]["ids"] or got[k]["logprobs"] != ref[k]["logprobs"]
        or got[k]["finish"] != ref[k]["finish"]
    ]
    aborts = [got[k]["aborts"] for k in ok]
    waits = np.array([got[k]["paused_wait_s"] for k in ok] or [0.0])
    lat = np.array([got[k]["latency_s"] for k in ok] or [0.0])
    ref_lat = np.array([ref[k]["latency_s"] for k in ref] or [0.0])
    return {
        "turns_expected": expected_turns,
        "turns_reference": len(ref),
        "turns_completed": len(ok),
        "lost_turns": len(lost) + (expected_turns - len(ref)),
        "http_5xx": sum(1 for e in errors if e["status"] >= 500),
        "errors": sorted({e["error"] for e in errors})[:10],
        "truncated_turns": len(truncated),
        "token_mismatches": len(mismatched),
        "tokens_compared": sum(len(got[k]["ids"]) for k in ok),
        "aborts": int(sum(aborts)),
        "empty_aborts": int(sum(got[k]["empty_aborts"] for k in ok)),
        "resubmits": int(sum(got[k]["resubmits"] for k in ok)),
        "turns_with_aborts": int(sum(1 for a in aborts if a)),
        "max_aborts_in_one_turn": int(max(aborts, default=0)),
        "paused_wait_s_total": float(waits.sum()),
        "paused_wait_s_p50": float(np.percentile(waits, 50)),
        "paused_wait_s_p99": float(np.percentile(waits, 99)),
        "turn_latency_s_p50": float(np.percentile(lat, 50)),
        "turn_latency_s_p99": float(np.percentile(lat, 99)),
        "reference_turn_latency_s_p50": float(np.percentile(ref_lat, 50)),
        "reference_turn_latency_s_p99": float(np.percentile(ref_lat, 99)),
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    user_turn = _encoder(args.tokenizer)
    with sim_engine(args.protocol, args.tokenizer, latency_ms=args.latency_ms) as url:
        ref, ref_info = await _run(url, args.protocol, user_turn, args.sessions, args.turns,
                                   args.max_tokens, None)
        hold_s, grace_s = args.hold_ms / 1000.0, args.grace_ms / 1000.0
        # one cycle closes the gate for grace + hold: fit all cycles inside the reference duration
        interval_s = max(0.01, ref_info["wall_s"] / (args.cycles + 1) - hold_s - grace_s)
        storm = {"cycles": args.cycles, "interval_s": interval_s, "hold_s": hold_s,
                 "grace_s": grace_s}
        got, storm_info = await _run(url, args.protocol, user_turn, args.sessions, args.turns,
                                     args.max_tokens, storm)
    expected = args.sessions * args.turns
    result = {
        "config": {
            "protocol": args.protocol, "tokenizer": args.tokenizer, "sessions": args.sessions,
            "turns_per_session": args.turns, "max_tokens": args.max_tokens,
            "latency_ms_per_token": args.latency_ms, "cycles_requested": args.cycles,
            "pause_interval_s": interval_s, "hold_s": hold_s, "grace_s": storm["grace_s"],
            "mode": "abort",
        },
        "reference": {"wall_s": ref_info["wall_s"], "control": ref_info["control"]},
        "storm": {
            "wall_s": storm_info["wall_s"],
            "cycles_completed": len(storm_info["cycles"]),
            "pause_failures": sum(1 for c in storm_info["cycles"] if not c["pause_ok"]),
            "resume_failures": sum(1 for c in storm_info["cycles"] if not c["resume_ok"]),
            "in_flight_at_pause_mean": float(np.mean(
                [c["in_flight_at_pause"] for c in storm_info["cycles"]] or [0])),
            "control": storm_info["control"],
        },
        **_compare(ref, got, expected),
    }
    result["passed"] = (
        result["lost_turns"] == 0 and result["truncated_turns"] == 0
        and result["token_mismatches"] == 0 and result["http_5xx"] == 0
        and result["storm"]["cycles_completed"] == args.cycles
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--protocol", choices=("sglang", "vllm"), default="sglang")
    ap.add_argument("--tokenizer", default="qwen3")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=4, help="turns per session, in sequence")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--latency-ms", type=float, default=3.0, help="simulated latency per token")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--hold-ms", type=float, default=50.0, help="time paused per cycle")
    ap.add_argument("--grace-ms", type=float, default=50.0)
    args = ap.parse_args()
    result = asyncio.run(_main(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("errors",)}, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
