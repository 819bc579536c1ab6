"""The vLLM wire of the simulated engine: `/inference/v1/generate` (token-in),
`/v1/completions`, aborts, pause/resume, models, version and the prefix-cache
metrics, shaped as current vLLM does; generations stream when asked (`stream: true`)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from session_server.engines.base import SESSION_HEADER
from session_server.sim.engine import EngineCore
from session_server.sim.faults import VALUE_FAULTS, answer_fault, stream_view
from session_server.sim.job import Job, Outcome
from session_server.sim.routed import RoutedSpec, vllm_payload
from session_server.sim.wire import (
    ENCODER,
    Constraint,
    attach_constraint,
    finish_job,
    json_response,
    request_seed,
    run_job,
    salt,
    stop_strings,
    trace_headers,
    trim_at_stop,
)

__all__ = ["VLLMWire", "vllm_constraint"]

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "choice",
               "json_object": "json_object", "structural_tag": "structural_tag"}


def vllm_error(status: int, message: str) -> web.Response:
    err_type = "BadRequestError" if status < 500 else "InternalServerError"
    return json_response({"error": {"message": message, "type": err_type, "param": None, "code": status}}, status)


def vllm_constraint(so: Any) -> Constraint:
    """vLLM `structured_outputs`: exactly one kind of constraint (StructuredOutputsParams)."""
    if so is None:
        return None
    if not isinstance(so, dict):
        return "structured_outputs must be an object"
    found = [(k, so[k]) for k in _VLLM_KINDS if so.get(k) not in (None, False)]
    if len(found) > 1:
        return f"You can only use one kind of structured outputs constraint but multiple are specified: {so}"
    if not found:
        return None
    kind, value = found[0]
    if kind == "json_object":
        return ("json_schema", '{"type": "object"}')
    if kind == "json" and not isinstance(value, str):
        value = msgspec.json.encode(value).decode()
    return (_VLLM_KINDS[kind], value)


def _finish(job: Job, out: Outcome) -> tuple[str, Any]:
    """vLLM's finish_reason and stop_reason (the matched id only when it was a stop id)."""
    stop_reason = out.matched if out.finish == "stop" and (
        out.matched in job.stop_ids or isinstance(out.matched, str)) else None
    return out.finish, stop_reason


def _usage(out: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.ids),
        "total_tokens": out.prompt_tokens + len(out.ids),
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def _dp_rank(request: web.Request, dp: int) -> int | None | web.Response:
    """The `X-data-parallel-rank` header (None when absent), or vLLM's 400."""
    header = request.headers.get("X-data-parallel-rank")
    if header is None:
        return None
    try:
        rank = int(header)
    except ValueError:
        return vllm_error(400, f"bad X-data-parallel-rank {header!r}")
    if not 0 <= rank < dp:
        return vllm_error(400, f"X-data-parallel-rank {rank} out of range [0, {dp})")
    return rank


def _slice_logprobs(lp: Any, start: int) -> Any:
    """A choice's logprobs from token `start` on (chat-style `content` or completions lists)."""
    if not isinstance(lp, dict):
        return lp
    return {k: v[start:] if isinstance(v, list) else v for k, v in lp.items()}


def _chunk(body: dict[str, Any], start: int, *, final: bool) -> dict[str, Any]:
    """One stream chunk of a whole answer `body`: its tokens from `start` on; the finish
    reason, routed experts and usage only at the end (usage goes in its own chunk)."""
    choice = dict(body["choices"][0])
    choice["token_ids"] = choice["token_ids"][start:]
    choice["logprobs"] = _slice_logprobs(choice.get("logprobs"), start)
    if "text" in choice:  # completions: the text of these tokens (`text_offset` says where it starts)
        offsets = (body["choices"][0].get("logprobs") or {}).get("text_offset") or []
        choice["text"] = choice["text"][offsets[start]:] if start < len(offsets) else ""
    if start:
        choice.pop("prompt_token_ids", None)
    if not final:
        choice["finish_reason"] = choice["stop_reason"] = None
        choice.pop("routed_experts", None)
        if "weight_versions" in choice:
            choice["weight_versions"] = None
    return {**body, "choices": [choice], "usage": None}


def engine_id(job: Job) -> str:
    """vLLM's own id of a request: the client's id behind a per-endpoint prefix (0.32:
    `generate-tokens-` on the token-in endpoint, `cmpl-` on completions). Replies echo it
    and `/abort_requests` matches it, never the bare id."""
    return ("generate-tokens-" if job.path == "/inference/v1/generate" else "cmpl-") + job.rid


class VLLMWire:
    """vLLM's HTTP endpoints over one `EngineCore`."""

    def __init__(self, engine: EngineCore, padding: msgspec.Raw | None = None,
                 routed: RoutedSpec | None = None) -> None:
        self.engine = engine
        self.padding = padding
        # vLLM's server flag `--enable-return-routed-experts`: every answer carries them
        self.routed = routed

    def _routed_payload(self, job: Job, out: Outcome) -> Any:
        """A choice's `routed_experts`: the padding, else with the flag the rows of the
        whole sequence (base64 `.npy`), `null` when aborted before any forward pass."""
        if self.padding is not None or self.routed is None:
            return self.padding
        if not out.ids and out.finish == "abort":
            return None
        if out.finish == "length" and len(out.ids) < job.max_tokens:
            return None  # a stream frame of a running job: `_chunk` drops the field anyway
        real = [int(t) for t in out.ids if not isinstance(t, bool)]
        return vllm_payload([*job.input_ids, *real], self.routed, job.fault)

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/inference/v1/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/version", self.version)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/abort_requests", self.abort)
        r.add_post("/inference/v1/abort_requests", self.abort_tokens_in)
        r.add_get("/metrics", self.metrics)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/weight_info", self.weight_info)

    def _job(self, request: web.Request, body: Any, ids_key: str, path: str) -> Job | web.Response:
        if not isinstance(body, dict):
            return vllm_error(400, "request body must be a JSON object")
        prompt = body.get(ids_key)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return vllm_error(400, f"{ids_key} must be a list of token ids (the simulator is token-in only)")
        sp = body.get("sampling_params") if ids_key == "token_ids" else body
        if not isinstance(sp, dict):
            return vllm_error(400, "sampling_params must be an object")
        rank = _dp_rank(request, self.engine.dp)
        if isinstance(rank, web.Response):
            return rank
        job = Job(
            rid=str(body.get("request_id") or uuid.uuid4().hex),
            input_ids=list(prompt),
            max_tokens=int(sp.get("max_tokens") or 16),
            stop_ids=frozenset(sp.get("stop_token_ids") or ()),
            stop_strs=stop_strings(sp.get("stop")),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            top_k=int(sp.get("logprobs") or 0),
            pinned_rank=rank,
            params={k: v for k, v in sp.items() if k != ids_key},
            path=path,
            seed=request_seed(sp.get("seed")),
            fault=self.engine.faults.take(),
            cache_salt=salt(body.get("cache_salt")),
            trace_headers=trace_headers(request),
            session=request.headers.get(SESSION_HEADER),
        )
        refused = attach_constraint(self.engine, job, vllm_constraint(sp.get("structured_outputs")), vllm_error)
        return job if refused is None else refused

    async def _answer(
        self, request: web.Request, ids_key: str, path: str, shape: Callable[[Job, Outcome], Any]
    ) -> web.StreamResponse:
        """Parse, run and answer one request: an error, a fault, or `shape(job, outcome)`."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return vllm_error(400, f"invalid JSON: {exc}")
        if path == "/v1/completions" and body.get("stream_options") and not body.get("stream"):
            # vLLM 0.32 refuses this (entrypoints/openai/completion/protocol.py, validate_stream_options)
            return vllm_error(400, "Stream options can only be defined when `stream=True`.")
        job = self._job(request, body, ids_key, path)
        if isinstance(job, web.Response):
            return job
        if body.get("stream"):
            # a usage frame only when asked, on both endpoints (0.32, as captured)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, job, shape, usage=usage)
        out = await run_job(self.engine, request, job, vllm_error)
        return out if isinstance(out, web.StreamResponse) else json_response(shape(job, out))

    async def _stream(
        self, request: web.Request, job: Job, shape: Callable[[Job, Outcome], Any], *, usage: bool
    ) -> web.StreamResponse:
        """SSE as vLLM streams: a delta chunk per sampled token (`token_ids`, logprobs),
        the finish reason on the last, a usage chunk without choices, `[DONE]`. A job
        with a value fault sends its tokens in the last chunk, where the fault lands."""
        early = await answer_fault(self.engine, request, job, vllm_error)
        if early is not None:
            return early
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0

        async def frame(partial: Outcome) -> None:
            nonlocal sent
            if job.fault in VALUE_FAULTS or partial.finish != "length" or len(partial.ids) >= job.max_tokens:
                return  # the last token goes out with the finish reason
            shown = stream_view(self.engine.model, job, partial)
            await resp.write(b"data: " + ENCODER.encode(_chunk(shape(job, shown), sent, final=False)) + b"\n\n")
            sent = len(partial.ids)

        out = await self.engine.generate(job, on_token=frame)
        finish_job(self.engine, job, out)
        last = shape(job, out)
        await resp.write(b"data: " + ENCODER.encode(_chunk(last, sent, final=True)) + b"\n\n")
        if usage:
            tail = {k: last.get(k) for k in ("id", "request_id", "object", "created", "model") if k in last}
            await resp.write(b"data: " + ENCODER.encode({**tail, "choices": [], "usage": last["usage"]}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "token_ids", "/inference/v1/generate", self._generate_body)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "prompt", "/v1/completions", self._completions_body)

    def _generate_body(self, job: Job, out: Outcome) -> dict[str, Any]:
        """`/inference/v1/generate`: token ids with per-token logprob entries."""
        finish, stop_reason = _finish(job, out)
        content = [
            {
                "token_id": t,
                "logprob": lp,
                "rank": 1,
                "top_logprobs": [
                    {"token_id": a, "logprob": alp, "rank": r + 1}
                    for r, (a, alp) in enumerate(out.tops[i] if out.tops else [(t, lp)])
                ],
            }
            for i, (t, lp) in enumerate(zip(out.ids, out.lps, strict=True))
        ]
        if job.fault == "length_mismatch" and content:
            content.pop()
        return {
            "request_id": engine_id(job),
            "choices": [
                {
                    "index": 0,
                    "logprobs": {"content": content},
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "token_ids": out.ids,
                    "routed_experts": self._routed_payload(job, out),
                    # 0.32: per-token spans of the versions that sampled them (the last frame only)
                    "weight_versions": [{"version": v, "start": a, "end": b} for a, b, v in out.version_spans],
                }
            ],
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "usage": _usage(out),
        }

    def _completions_body(self, job: Job, out: Outcome) -> dict[str, Any]:
        """`/v1/completions` with token-id prompts: text, OpenAI logprobs and the ids."""
        finish, stop_reason = _finish(job, out)
        tokens = [f"token_id:{t}" for t in out.ids]
        token_logprobs = list(out.lps)
        if job.fault == "length_mismatch" and token_logprobs:
            token_logprobs.pop()
            tokens.pop()
        decode = self.engine.model.decode
        pieces = [decode([int(t)]) if not isinstance(t, bool) else "" for t in out.ids]
        offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else []
        tops = (
            [{f"token_id:{a}": alp for a, alp in top} for top in out.tops]
            if out.tops
            else [{f"token_id:{t}": lp} for t, lp in zip(out.ids, out.lps, strict=True)]
        )
        return {
            "id": engine_id(job),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.engine.model.name,
            "choices": [
                {
                    "index": 0,
                    "text": trim_at_stop("".join(pieces), out, keep=bool(job.params.get("include_stop_str_in_output"))),
                    "logprobs": {
                        "text_offset": offsets,
                        "token_logprobs": token_logprobs,
                        "tokens": tokens,
                        "top_logprobs": tops,
                    },
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "token_ids": out.ids,
                    "prompt_token_ids": job.input_ids,
                    "prompt_logprobs": None,
                    "routed_experts": self._routed_payload(job, out),
                }
            ],
            "usage": _usage(out),
            "kv_transfer_params": None,
        }

    async def models(self, request: web.Request) -> web.Response:
        name = self.engine.model.name
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "vllm",
                        "root": name,
                        "parent": None,
                        "max_model_len": self.engine.caches[0].capacity_tokens,
                        "simulated": True,
                    }
                ],
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        """`GET /version`: the release whose wire the sim follows (0.32: per-token versions)."""
        return json_response({"version": "0.32.0"})

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return json_response({"error": f"Invalid mode {mode!r}: expected abort, wait or keep"}, 400)
        self.engine.pause(mode)
        await self.engine.settle_aborts()
        if request.query.get("clear_cache", "").lower() == "true":
            self.engine.flush_caches()
        return json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"status": "resumed"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        answer, status = self.engine.set_weight_version(await request.read(), honours_abort_all=False)
        return json_response(answer, status)

    async def weight_info(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.weight_version})

    async def is_paused(self, request: web.Request) -> web.Response:
        return json_response({"is_paused": self.engine.paused is not None})

    async def abort(self, request: web.Request) -> web.Response:
        """`/abort_requests` (dev mode): by the engine's own ids only (a bare request id
        aborts nothing, 0.32 as captured); an empty list aborts everything."""
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        ids = set(body.get("request_ids") or ())
        hits = [j for j in self.engine.running.values() if not ids or engine_id(j) in ids]
        self.engine.abort_where("/abort_requests", body, lambda job: not ids or engine_id(job) in ids)
        return json_response({"status": "aborted", "aborted": len(hits)})

    async def abort_tokens_in(self, request: web.Request) -> web.Response:
        """`/inference/v1/abort_requests`: the listed ids only (an empty list aborts
        nothing), an empty 200 (0.32, as captured)."""
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        ids = set(body.get("request_ids") or ())
        self.engine.abort_where("/inference/v1/abort_requests", body, lambda job: engine_id(job) in ids)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM's prefix-cache counters and its running/waiting gauges, per DP rank (`engine` label)."""
        e, name = self.engine, self.engine.model.name
        lines = [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
        ]
        for r, c in enumerate(e.caches):
            lines.append(f'vllm:prefix_cache_queries_total{{engine="{r}",model_name="{name}"}} {float(c.queries_tokens)}')
        lines += [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
        ]
        for r, c in enumerate(e.caches):
            lines.append(f'vllm:prefix_cache_hits_total{{engine="{r}",model_name="{name}"}} {float(c.hits_tokens)}')
        lines += ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                  "# TYPE vllm:num_requests_running gauge"]
        for r in range(e.dp):
            lines.append(f'vllm:num_requests_running{{engine="{r}",model_name="{name}"}} {float(e.running_on(r))}')
        lines += ["# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                  "# TYPE vllm:num_requests_waiting gauge"]
        for r in range(e.dp):
            lines.append(f'vllm:num_requests_waiting{{engine="{r}",model_name="{name}"}} {float(e.waiting_on(r))}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
