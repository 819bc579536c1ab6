"""Small helpers of the real-engine suite: sessions, trajectories and their comparison with
what the recording proxy saw the engine do."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import numpy as np

from .recorder import Exchange, Recorder

__all__ = ["engine_generated", "engine_queued", "engine_running", "new_session", "next_version", "own_turns", "relative_spans", "trajectory",
           "turn_exchanges", "wait_until"]


async def new_session(http: httpx.AsyncClient, **config: Any) -> str:
    r = await http.post("/sessions", json=config)
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


async def trajectory(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    r = await http.get(f"/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    return dict(r.json())


def own_turns(traj: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """The active (last) branch's ids, mask, logprobs and turns; the line starts at 0 for a
    session that never forked."""
    b = traj["branches"][-1]
    return (np.asarray(b["token_ids"]), np.asarray(b["loss_mask"]), np.asarray(b["logprobs"], dtype=np.float64),
            list(b["turns"]))


def relative_spans(turn: dict[str, Any]) -> list[tuple[int, int, Any]]:
    """A turn's weight spans relative to its sampled ids (the record keeps line positions)."""
    o = turn["output_start"]
    return [(s - o, e - o, v) for s, e, v in turn["weight_spans"]]


def turn_exchanges(rec: Recorder, line: np.ndarray, turn: dict[str, Any]) -> list[Exchange]:
    """The engine requests of one committed turn, in order: those whose prompt is the
    turn's context (`line[:output_start]`), then that context plus a kept partial."""
    context = line[: turn["output_start"]].tolist()
    n = len(context)
    return [e for e in rec.generations()
            if e.request.get("token_ids", e.request.get("prompt", []))[:n] == context
            and len(e.request.get("token_ids", e.request.get("prompt", []))) < turn["output_end"]]


async def next_version(http: httpx.AsyncClient) -> int:
    """One past the server's current weight version (versions are monotone per server)."""
    state = (await http.get("/control/state")).json()
    return 1 + int(state["weight_version"] if state["weight_version"] is not None else 0)


_RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*\}\s+([0-9.e+]+)', re.M)
_WAITING = re.compile(r'^vllm:num_requests_waiting\{[^}]*\}\s+([0-9.e+]+)', re.M)
_GENERATED = re.compile(r'^vllm:generation_tokens_total\{[^}]*\}\s+([0-9.e+]+)', re.M)


async def engine_running(engine_url: str) -> float:
    """vLLM's own count of running requests (its /metrics gauge, summed over engines)."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(engine_url + "/metrics")).text
    return sum(float(v) for v in _RUNNING.findall(text))


async def engine_queued(engine_url: str) -> float:
    """vLLM's running plus waiting requests: 0 when nothing of an earlier test is left."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(engine_url + "/metrics")).text
    return sum(float(v) for v in [*_RUNNING.findall(text), *_WAITING.findall(text)])


async def engine_generated(engine_url: str) -> float:
    """vLLM's own count of tokens sampled since it started (all requests)."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(engine_url + "/metrics")).text
    return sum(float(v) for v in _GENERATED.findall(text))


async def wait_until(pred: Any, timeout_s: float, what: str, every_s: float = 0.1) -> None:
    """Poll the async predicate until it holds (a test's bounded wait for an engine state)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)
