"""What the SGLang and vLLM wire modules share: JSON answers, the response padding,
cache-salt and constraint handling, and the run of one parsed request."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from aiohttp import web

from session_server.sim.constrained import ConstraintError, constrained_text
from session_server.sim.engine import EngineCore
from session_server.sim.faults import ErrorResponder, answer_fault, apply_value_fault
from session_server.sim.job import Job, Outcome

__all__ = ["ENCODER", "Constraint", "attach_constraint", "json_response", "padding_payload",
           "request_seed", "run_job", "salt", "stop_strings", "trace_headers", "trim_at_stop"]

ENCODER = msgspec.json.Encoder()

# a (kind, value) constraint, the engine's refusal text, or None (unconstrained)
Constraint = tuple[str, Any] | str | None


def request_seed(value: Any) -> int | None:
    """A request's own sampling seed (SGLang `sampling_seed`, vLLM `seed`): an int, else
    none (the engines type it an optional int)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=ENCODER.encode(data), status=status, content_type="application/json")


def trace_headers(request: web.Request) -> dict[str, str]:
    """The request's W3C `traceparent` / `tracestate`, as both engines read them from the
    HTTP headers of a generate request (SGLang `tokenizer_manager._trace_request_start`:
    `extract_trace_headers(request.headers)`; vLLM `vllm/tracing.py` TRACE_HEADERS). The
    simulator traces nothing: it keeps them in its request log, where a test sees what the
    engine received."""
    return {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k)) is not None}


def padding_payload(kind: str) -> msgspec.Raw:
    """The benchmark's routed_experts payload: 900 rows x 256 floats, or one base64 string."""
    if kind == "floats":
        row = ENCODER.encode([round(i * 0.001, 4) for i in range(256)])
        return msgspec.Raw(b"[" + b",".join([row] * 900) + b"]")
    if kind == "base64":
        raw = bytes(i % 251 for i in range(900 * 64 * 8 * 2))  # int32 (900, 64 layers, topk 8) /2
        return msgspec.Raw(ENCODER.encode(base64.b64encode(raw).decode()))
    raise ValueError(f"padding must be 'floats' or 'base64', not {kind!r}")


def salt(value: Any) -> str | None:
    """SGLang `extra_key` / vLLM `cache_salt` as the cache's namespace key."""
    return None if value is None else str(value)


def stop_strings(value: Any) -> tuple[str, ...]:
    """The request's `stop` (both engines take one string or a list) as a tuple."""
    if isinstance(value, str):
        return (value,) if value else ()
    return tuple(s for s in value or () if isinstance(s, str) and s)


def trim_at_stop(text: str, out: Outcome, *, keep: bool) -> str:
    """The output text as the engine shows it after a stop-string match: cut after the
    string (`keep`: vLLM `include_stop_str_in_output`, SGLang `no_stop_trim`) or before
    it. Only the text: both engines keep every sampled id."""
    if out.finish != "stop" or not isinstance(out.matched, str):
        return text
    at = text.find(out.matched)
    if at < 0:
        return text
    return text[: at + len(out.matched)] if keep else text[:at]


def attach_constraint(
    engine: EngineCore, job: Job, found: Constraint, error: ErrorResponder
) -> web.Response | None:
    """Attach the text a constraint forces; the engine's 400 when it is invalid."""
    if found is None:
        return None
    if isinstance(found, str):
        return error(400, found)
    if engine.model.encode is None:
        return error(400, "this simulated model cannot follow constraints (no tokenizer)")
    try:
        job.constrained = constrained_text(*found)
    except ConstraintError as exc:
        return error(400, str(exc))
    return None


async def run_job(
    engine: EngineCore, request: web.Request, job: Job, error: ErrorResponder
) -> Outcome | web.StreamResponse:
    """A non-streamed request: an answer-replacing fault, or the (faulted) logged outcome."""
    early = await answer_fault(engine, request, job, error)
    if early is not None:
        return early
    out = await engine.generate(job)
    finish_job(engine, job, out)
    return out


def finish_job(engine: EngineCore, job: Job, out: Outcome) -> None:
    """Apply the job's value fault and log it, as both wires do before answering."""
    apply_value_fault(engine.model, job, out)
    engine.log(job, out, 200)
