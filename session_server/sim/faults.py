"""Fault injection of the simulated engines: the kinds, the queue, and how each one acts.

A fault is queued by `POST /sim/faults` and taken by the next requests in arrival
order. It acts at one of four places: it replaces the whole answer (`answer_fault`:
HTTP errors, a stall, a dropped connection), it ends generation early (`abort_at`:
`abort_midway`, vLLM's `repetition`), it corrupts the values of a finished output
(`apply_value_fault`) so the server's validation can be tested on a wire-shaped lie,
or it corrupts only what a streamed answer shows as it runs (`stream_view`: the
`stream_*` kinds), the final answer staying clean, so a server that checks only the
final answer would pass on a lie the agent was already shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from session_server.sim.routed import ROUTED_FAULTS

if TYPE_CHECKING:
    from session_server.sim.job import Job, Outcome
    from session_server.sim.sampler import SimModel

__all__ = ["FAULT_KINDS", "VALUE_FAULTS", "FaultHost", "FaultQueue", "abort_at", "answer_fault", "apply_value_fault",
           "stream_view"]

FAULT_KINDS = (
    "http_500",  # HTTP 500 with the engine's error body
    "http_400",  # HTTP 400 with the engine's error body
    "abort_midway",  # abort after half the planned tokens (HTTP 200, abort finish)
    "stall",  # never answer (until the client gives up or the server stops)
    "disconnect",  # close the connection without an answer
    "nan_logprob",  # first logprob NaN (null on the wire, as orjson/pydantic write it)
    "oov_id",  # first id >= vocab size
    "length_mismatch",  # one logprob entry fewer than ids
    "bool_id",  # first id is JSON `true`
    "positive_logprob",  # first logprob 0.5
    "prompt_tokens_mismatch",  # prompt_tokens off by one
    "cached_above_prompt",  # cached_tokens > prompt_tokens
    "bad_finish",  # finish inconsistent with the output (length <-> stop)
    "repetition",  # vLLM: the repetition detector stops after half the planned tokens (SGLang: none)
    "pass",  # no fault: queued first, it lets the next fault land on a later request
    # the step that would stop the request (a stop id or string) waits for a pause or an abort;
    # aborted there, it reports `abort` with that token (SGLang checks abort before stop)
    "hold_on_stop",
    "hold_before_stop",  # the same one step earlier: a pause there splits a multi-token stop string
    *ROUTED_FAULTS,  # routing replay: the answer's routed experts bent (sim/routed.py)
    # streamed answers only: the frames sent while running show a lie, the final answer is clean
    # (vLLM streams deltas, so its final answer is the frames joined: the lie lands there too)
    "stream_diverges",  # first id shown as another valid id
    "stream_logprob_diverges",  # first logprob shown 0.25 lower (still valid)
    "stream_oov_id",  # first id shown >= vocab size
    "stream_negative_id",  # first id shown as -1
    "stream_nan_logprob",  # first logprob shown NaN (null on the wire)
    "stream_positive_logprob",  # first logprob shown 0.5
)

# faults that corrupt a finished output's values (`apply_value_fault`)
VALUE_FAULTS = frozenset({"nan_logprob", "oov_id", "length_mismatch", "bool_id", "positive_logprob",
                          "prompt_tokens_mismatch", "cached_above_prompt", "bad_finish"})

_STREAM_LIES: dict[str, Callable[[SimModel, Outcome], None]] = {
    "stream_diverges": lambda m, o: o.ids.__setitem__(0, (int(o.ids[0]) + 1) % m.vocab_size),
    "stream_logprob_diverges": lambda m, o: o.lps.__setitem__(0, float(o.lps[0]) - 0.25),
    "stream_oov_id": lambda m, o: o.ids.__setitem__(0, m.vocab_size + 7),
    "stream_negative_id": lambda m, o: o.ids.__setitem__(0, -1),
    "stream_nan_logprob": lambda m, o: o.lps.__setitem__(0, float("nan")),
    "stream_positive_logprob": lambda m, o: o.lps.__setitem__(0, 0.5),
}

ErrorResponder = Callable[[int, str], web.Response]


class FaultQueue:
    """Pending faults as [kind, remaining] in the order they were queued."""

    def __init__(self) -> None:
        self._pending: list[list[Any]] = []

    def add(self, kind: str, count: int) -> None:
        if count > 0:
            self._pending.append([kind, count])

    def take(self) -> str | None:
        """The kind the next request suffers (one use of the oldest pending fault), if any."""
        while self._pending:
            kind, remaining = self._pending[0]
            if remaining <= 0:
                self._pending.pop(0)
                continue
            self._pending[0][1] -= 1
            return str(kind)
        return None

    def pending(self) -> list[list[Any]]:
        return [[k, n] for k, n in self._pending if n > 0]

    def clear(self) -> None:
        self._pending.clear()


def abort_at(fault: str | None, protocol: str, planned_left: int, max_tokens: int) -> int | None:
    """The step at which a mid-generation fault ends the output (None: it does not)."""
    if fault == "abort_midway" or (fault == "repetition" and protocol == "vllm"):
        return max(1, min(max_tokens, max(1, planned_left)) // 2)
    return None


class FaultHost(Protocol):
    """What a whole-answer fault needs of the engine: its request log and its shutdown
    signal (the core provides both; naming them here keeps faults below the core)."""

    closing: asyncio.Event

    def log(self, job: Job, out: Outcome | None, status: int) -> None: ...


async def answer_fault(
    engine: FaultHost, request: web.Request, job: Job, error: ErrorResponder
) -> web.StreamResponse | None:
    """Faults that replace the whole answer; None when the request should run."""
    kind = job.fault
    if kind in ("http_500", "http_400"):
        status = 500 if kind == "http_500" else 400
        engine.log(job, None, status)
        return error(status, f"simulated fault {kind}")
    if kind == "stall":
        engine.log(job, None, 0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.closing.wait(), timeout=3600)
        return error(503, "simulated stall ended by shutdown")
    if kind == "disconnect":
        engine.log(job, None, 0)
        if request.transport is not None:
            request.transport.close()
        raise asyncio.CancelledError  # aiohttp drops the request without a response
    return None


def apply_value_fault(model: SimModel, job: Job, out: Outcome) -> None:
    """Corrupt a finished output in place the way `job.fault` says (no-op for other kinds)."""
    kind = job.fault
    if kind == "nan_logprob" and out.lps:
        out.lps[0] = float("nan")
    elif kind == "oov_id" and out.ids:
        out.ids[0] = model.vocab_size + 7
    elif kind == "bool_id" and out.ids:
        out.ids[0] = True
    elif kind == "positive_logprob" and out.lps:
        out.lps[0] = 0.5
    elif kind == "prompt_tokens_mismatch":
        out.prompt_tokens += 1
    elif kind == "cached_above_prompt":
        out.cached_tokens = out.prompt_tokens + 5
    elif kind == "bad_finish":
        if out.finish == "stop":
            out.finish, out.matched = "length", None
        else:
            out.finish, out.matched = "stop", model.eos_ids[0]
            if out.ids and out.ids[-1] == out.matched:
                out.matched = model.eos_ids[-1] + 1


def stream_view(model: SimModel, job: Job, partial: Outcome) -> Outcome:
    """What a streamed frame shows of `partial` (the output so far): itself, or for a
    `stream_*` fault a corrupted copy (the running output, hence the final answer, stays clean)."""
    lie = _STREAM_LIES.get(job.fault or "")
    if lie is None or not partial.ids:
        return partial
    shown = dataclasses.replace(partial, ids=list(partial.ids), lps=list(partial.lps))
    lie(model, shown)
    return shown
