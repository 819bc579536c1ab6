"""The SGLang wire of the simulated engine: `/generate` (streamed or not), aborts,
pause/continue, flush_cache and the info endpoints, shaped as current SGLang does."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from aiohttp import web

from session_server.engines.base import SESSION_HEADER
from session_server.sim.engine import PAUSE_MODES, EngineCore
from session_server.sim.faults import answer_fault, stream_view
from session_server.sim.job import Job, Outcome
from session_server.sim.routed import DEFAULT_ROUTED, RoutedSpec, sglang_payload
from session_server.sim.wire import (
    ENCODER,
    Constraint,
    attach_constraint,
    finish_job,
    json_response,
    request_seed,
    salt,
    stop_strings,
    trace_headers,
    trim_at_stop,
)

__all__ = ["SGLangWire", "sglang_constraint"]

_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)"
)


def sglang_error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message}}, status)


def sglang_constraint(sp: dict[str, Any]) -> Constraint:
    """SGLang sampling params `json_schema` / `regex` / `ebnf`: at most one (its `verify`)."""
    found = [(k, sp[k]) for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if len(found) > 1:
        return "Only one of regex, json_schema, or ebnf can be set."
    return found[0] if found else None


class SGLangWire:
    """SGLang's HTTP endpoints over one `EngineCore`."""

    def __init__(self, engine: EngineCore, padding: msgspec.Raw | None = None,
                 routed: RoutedSpec | None = DEFAULT_ROUTED, incremental: bool = False) -> None:
        self.engine = engine
        self.padding = padding
        self.routed = routed  # routed experts answered when a request asks (routing replay)
        # SGLang's `--incremental-streaming-output`: each stream frame holds only what is new
        self.incremental = incremental

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/generate", self.generate)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_load", self.load)
        r.add_post("/abort_request", self.abort)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/flush_cache", self.flush)
        r.add_post("/update_weight_version", self.update_weight_version)

    def body(self, job: Job, out: Outcome, final: bool) -> dict[str, Any]:
        """One `/generate` answer (or stream frame) for the output so far."""
        fr: Any = None
        if final:
            if out.finish == "stop":
                fr = {"type": "stop", "matched": out.matched}
            elif out.finish == "length":
                fr = {"type": "length", "length": len(out.ids)}
            else:
                fr = {"type": "abort", "message": out.abort_message}
        ids = list(out.ids)
        lps = list(out.lps)
        triples = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        if final and job.fault == "length_mismatch" and triples:
            triples.pop()
        version = out.weight_version if out.weight_version is not None else self.engine.weight_version
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": fr,
            "prompt_tokens": out.prompt_tokens,
            "weight_version": version,
            "total_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": triples,
            "completion_tokens": len(ids),
            "cached_tokens": out.cached_tokens,
            "cached_tokens_details": {"device": out.cached_tokens, "host": 0}
            if out.cached_tokens
            else None,
            "dp_rank": job.rank,
            "e2e_latency": out.e2e_s,
        }
        if out.tops is not None:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in out.tops]
        if self.padding is not None and final:
            meta["routed_experts"] = self.padding
        elif final and job.routed_start is not None and self.routed is not None:
            real = [int(t) for t in ids if not isinstance(t, bool)]
            meta["routed_experts"] = sglang_payload([*job.input_ids, *real], self.routed, job.routed_start, job.fault)
        vocab = self.engine.model.vocab_size  # a faulted id (out of range) has no text
        text = self.engine.model.decode([int(t) for t in ids if not isinstance(t, bool) and 0 <= int(t) < vocab])
        if final:
            text = trim_at_stop(text, out, keep=bool(job.params.get("no_stop_trim")))
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _job(self, request: web.Request, body: Any) -> Job | web.Response:
        """The `/generate` body as a Job, or SGLang's 400."""
        try:
            input_ids = [int(t) for t in body["input_ids"]]
        except (KeyError, TypeError, ValueError) as exc:
            return sglang_error(400, f"invalid /generate body: {exc}")
        if isinstance(body.get("rid"), list) or (input_ids and isinstance(body["input_ids"][0], list)):
            return sglang_error(400, "the simulator serves single requests, not batches")
        sp = body.get("sampling_params") or {}
        rank = body.get("data_parallel_rank")
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.engine.dp):
            return sglang_error(400, f"data_parallel_rank {rank} out of range [0, {self.engine.dp})")
        job = Job(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            input_ids=input_ids,
            max_tokens=int(sp.get("max_new_tokens", 128)),
            stop_ids=frozenset(sp.get("stop_token_ids") or ()),
            stop_strs=stop_strings(sp.get("stop")),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            top_k=int(body.get("top_logprobs_num") or 0),
            pinned_rank=rank,
            params=sp,
            path="/generate",
            seed=request_seed(sp.get("sampling_seed")),
            fault=self.engine.faults.take(),
            cache_salt=salt(body.get("extra_key")),
            routed_start=int(body.get("routed_experts_start_len") or 0) if body.get("return_routed_experts") else None,
            trace_headers=trace_headers(request),
            session=request.headers.get(SESSION_HEADER),
        )
        refused = attach_constraint(self.engine, job, sglang_constraint(sp), sglang_error)
        return job if refused is None else refused

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return sglang_error(400, f"invalid /generate body: {exc}")
        job = self._job(request, body)
        if isinstance(job, web.Response):
            return job
        early = await answer_fault(self.engine, request, job, sglang_error)
        if early is not None:
            return early
        if not body.get("stream"):
            out = await self.engine.generate(job)
            finish_job(self.engine, job, out)
            return json_response(self.body(job, out, final=True))
        return await self._stream(request, job)

    async def _stream(self, request: web.Request, job: Job) -> web.StreamResponse:
        """SSE: one frame per token while running, the final body, then `[DONE]`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        sent = [0, ""]  # incremental: ids and text already sent

        async def frame(partial: Outcome) -> None:
            if partial.finish == "length" and len(partial.ids) < job.max_tokens:
                data = self.body(job, stream_view(self.engine.model, job, partial), final=False)
                await resp.write(b"data: " + ENCODER.encode(self._delta(data, sent)) + b"\n\n")

        out = await self.engine.generate(job, on_token=frame)
        finish_job(self.engine, job, out)
        await resp.write(b"data: " + ENCODER.encode(self._delta(self.body(job, out, True), sent)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _delta(self, data: dict[str, Any], sent: list[Any]) -> dict[str, Any]:
        """A stream frame as SGLang sends it: cumulative by default; incremental, only the
        ids, their logprob entries and the text past what earlier frames sent, while
        `completion_tokens` still counts every token so far (its tokenizer manager slices
        the output fields from the request's last offset)."""
        if not self.incremental:
            return data
        ids, meta, text = data["output_ids"], data["meta_info"], data["text"]
        at = sent[0]
        meta["output_token_logprobs"] = meta["output_token_logprobs"][at:]
        if "output_top_logprobs" in meta:
            meta["output_top_logprobs"] = meta["output_top_logprobs"][at:]
        new_text = text[len(sent[1]):] if text.startswith(sent[1]) else ""  # a final text cut at its stop string
        sent[0], sent[1] = len(ids), text
        return {**data, "output_ids": ids[at:], "text": new_text}

    async def pause(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        mode = PAUSE_MODES.get(str(body.get("mode", "abort")))
        if mode is None:
            return sglang_error(400, f"unknown pause mode {body.get('mode')!r}")
        self.engine.pause(mode)
        await self.engine.settle_aborts()
        return json_response({"success": True, "message": f"Generation paused ({body.get('mode', 'abort')})."})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"success": True, "message": "Generation continued."})

    async def abort(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        rid = body.get("rid")
        self.engine.abort_where(
            "/abort_request", body, lambda job: bool(body.get("abort_all") or (rid and job.rid.startswith(rid)))
        )
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        name = self.engine.model.name
        return json_response(
            {
                "model_path": name,
                "tokenizer_path": name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "simulated",
                "architectures": ["SimulatedForCausalLM"],
                "simulated": True,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return json_response(
            {
                "model_path": e.model.name,
                "dp_size": e.dp,
                "tp_size": 1,
                "page_size": e.caches[0].page_size,
                "status": "ready",
                "max_total_num_tokens": e.caches[0].capacity_tokens,
                "internal_states": [{"dp_rank": r} for r in range(e.dp)],
                "version": "simulated",
                "incremental_streaming_output": self.incremental,
                "simulated": True,
            }
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        answer, status = self.engine.set_weight_version(await request.read(), honours_abort_all=True)
        return json_response({**answer, "message": f"Weight version updated to {answer.get('new_version')}"}
                             if status == 200 else answer, status)

    async def load(self, request: web.Request) -> web.Response:
        e = self.engine
        return json_response(
            [
                {
                    "dp_rank": r,
                    "num_reqs": e.running_on(r) + e.waiting_on(r),  # SGLang: running + waiting
                    "num_waiting_reqs": e.waiting_on(r),
                    "num_tokens": e.caches[r].used_tokens,
                }
                for r in range(e.dp)
            ]
        )

    async def flush(self, request: web.Request) -> web.Response:
        if self.engine.running:
            return web.Response(status=400, text=_FLUSH_TEXT)
        self.engine.flush_caches()
        return web.Response(status=200, text=_FLUSH_TEXT)
