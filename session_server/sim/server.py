"""The simulated SGLang / vLLM server (aiohttp.web), wire-faithful to current versions.

Owns the endpoints and their shapes, DP-rank dispatch (pinned or round robin),
per-rank prefix caches, per-token latency, pause modes, aborts, response padding,
fault injection (`POST /sim/faults`), the request log (`GET|DELETE /sim/requests`) and
the reported weight version (`GET|POST /sim/weight_version`, what a weight update sets).
Token choice is delegated to `sampler.ScriptedPolicy`. It says it is a simulator
(`"simulated": true`) in its info endpoints; generate responses carry only real fields.

Pause modes: `abort` (running requests return their partial output with the
engine's abort shape), `keep` (running requests freeze, continue on resume;
SGLang's `in_place`/`retract` behave so from outside), `wait` (running requests
finish); in every mode new requests are held until resume.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from session_server.sim.cache import PrefixCache
from session_server.sim.constrained import ConstraintError, constrained_text
from session_server.sim.sampler import ScriptedPolicy, SimModel, sim_model_from_tokenizer

__all__ = ["FAULT_KINDS", "SimEngine", "load_sim_model", "run_sim_engine", "running_sim"]

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
)
_PAUSE_MODES = {"abort": "abort", "keep": "keep", "wait": "wait", "in_place": "keep", "retract": "keep"}
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)"
)
_ENCODER = msgspec.json.Encoder()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_ENCODER.encode(data), status=status, content_type="application/json")


def _padding_payload(kind: str) -> msgspec.Raw:
    """The benchmark's routed_experts payload: 900 rows x 256 floats, or one base64 string."""
    if kind == "floats":
        row = _ENCODER.encode([round(i * 0.001, 4) for i in range(256)])
        return msgspec.Raw(b"[" + b",".join([row] * 900) + b"]")
    if kind == "base64":
        raw = bytes(i % 251 for i in range(900 * 64 * 8 * 2))  # int32 (900, 64 layers, topk 8) /2
        return msgspec.Raw(_ENCODER.encode(base64.b64encode(raw).decode()))
    raise ValueError(f"padding must be 'floats' or 'base64', not {kind!r}")


def _salt(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass
class _Job:
    rid: str
    input_ids: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    ignore_eos: bool
    top_k: int
    pinned_rank: int | None
    params: dict[str, Any]
    path: str
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    fault: str | None = None
    cache_salt: str | None = None  # SGLang extra_key / vLLM cache_salt: a KV namespace
    rank: int = 0
    produced: int = 0
    constrained: str | None = None  # the text a constraint forces (None: unconstrained)


@dataclass
class _Outcome:
    ids: list[Any]
    lps: list[Any]
    tops: list[list[tuple[int, float]]] | None
    finish: str  # stop | length | abort
    matched: int | None
    prompt_tokens: int
    cached_tokens: int
    abort_message: str | None = None
    e2e_s: float = 0.0
    weight_version: str | None = None  # the engine's version when the output was finalised


class SimEngine:
    """One simulated engine (all its DP ranks) for protocol "sglang" or "vllm"."""

    def __init__(
        self,
        protocol: str,
        model: SimModel,
        *,
        seed: int = 0,
        dp: int = 1,
        latency_ms: float = 0.0,
        request_latency_ms: float = 0.0,
        noncanonical: bool = False,
        padding: str | None = None,
        cache_capacity_tokens: int = 1 << 20,
        page_size: int | None = None,
        weight_version: str = "default",
        abort_plan: Sequence[int] = (),
    ) -> None:
        if protocol not in ("sglang", "vllm"):
            raise ValueError(f"protocol must be sglang or vllm, not {protocol!r}")
        if dp < 1:
            raise ValueError("dp must be >= 1")
        self.protocol = protocol
        self.model = model
        self.policy = ScriptedPolicy(model, seed=seed, noncanonical=noncanonical)
        self.dp = dp
        self.latency_ms = latency_ms
        self.request_latency_ms = request_latency_ms  # fixed per-request time (prefill/queueing)
        self.weight_version = weight_version
        self.padding = _padding_payload(padding) if padding else None
        ps = page_size or (1 if protocol == "sglang" else 16)
        self.caches = [PrefixCache(cache_capacity_tokens, ps) for _ in range(dp)]
        self.requests: list[dict[str, Any]] = []
        self.running: dict[str, _Job] = {}
        self.faults: list[list[Any]] = []  # [kind, remaining]
        self.paused: str | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._closing = asyncio.Event()
        self._rr = itertools.count()
        # per generation, in arrival order: abort right after the k-th sampled token, before
        # the stop check (SGLang checks the abort flag first, so the EOT step can be `abort`)
        self.abort_plan: list[int] = [int(k) for k in abort_plan]
        self.aborted_rids: list[str] = []  # every rid that ended with an abort, in order
        self.abort_calls: list[dict[str, Any]] = []  # every abort request received (GET /sim/aborts)

    # --- core ------------------------------------------------------------------------

    def _take_fault(self) -> str | None:
        while self.faults:
            kind, remaining = self.faults[0]
            if remaining <= 0:
                self.faults.pop(0)
                continue
            self.faults[0][1] -= 1
            return kind
        return None

    async def _wait_resumed(self, job: _Job) -> None:
        waiters = [asyncio.ensure_future(self._resumed.wait()), asyncio.ensure_future(job.abort.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _generate(
        self, job: _Job, on_token: Callable[[_Outcome], Awaitable[None]] | None = None
    ) -> _Outcome:
        t0 = time.monotonic()
        self.running[job.rid] = job
        try:
            while self.paused is not None and not job.abort.is_set():
                await self._wait_resumed(job)
            job.rank = job.pinned_rank if job.pinned_rank is not None else next(self._rr) % self.dp
            cache = self.caches[job.rank]
            cached = cache.match(job.input_ids, job.cache_salt)
            cursor = self.policy.start(job.input_ids, job.constrained)
            out = _Outcome([], [], [] if job.top_k else None, "length", None, len(job.input_ids), cached)
            abort_at = None
            if job.fault == "abort_midway" or (job.fault == "repetition" and self.protocol == "vllm"):
                remaining = max(1, len(cursor.planned) - cursor.offset)
                abort_at = max(1, min(job.max_tokens, remaining) // 2)
            eos = set(self.model.eos_ids)
            plan_at = self.abort_plan.pop(0) if self.abort_plan else None
            if self.request_latency_ms > 0:
                await asyncio.sleep(self.request_latency_ms / 1000.0)
            for i in range(job.max_tokens):
                if self.latency_ms > 0:
                    await asyncio.sleep(self.latency_ms / 1000.0)
                elif i % 32 == 31:
                    await asyncio.sleep(0)
                while self.paused == "keep" and not job.abort.is_set():
                    await self._wait_resumed(job)
                if abort_at is not None and i >= abort_at and job.fault == "repetition":
                    out.finish = "repetition"
                    break
                if job.abort.is_set() or (abort_at is not None and i >= abort_at):
                    out.finish, out.abort_message = "abort", "Abort in running batch."
                    break
                tok = cursor.token(i)
                out.ids.append(tok)
                out.lps.append(cursor.logprob(i, tok))
                if out.tops is not None:
                    out.tops.append(cursor.top(i, tok, job.top_k))
                job.produced = i + 1
                if plan_at is not None and i + 1 >= plan_at:
                    out.finish, out.abort_message = "abort", "Abort in running batch."
                    break
                if tok in job.stop_ids or (not job.ignore_eos and tok in eos):
                    out.finish, out.matched = "stop", tok
                if on_token is not None:
                    await on_token(out)
                if out.finish == "stop":
                    break
            if job.abort.is_set() and not out.ids:
                out.finish, out.abort_message = "abort", "Abort before prefill."
            if out.finish == "abort":
                self.aborted_rids.append(job.rid)
            cache.insert([*job.input_ids, *out.ids], job.cache_salt)
            out.e2e_s = time.monotonic() - t0
            out.weight_version = self.weight_version
            return out
        finally:
            self.running.pop(job.rid, None)

    def _apply_value_fault(self, job: _Job, out: _Outcome) -> None:
        kind = job.fault
        if kind == "nan_logprob" and out.lps:
            out.lps[0] = float("nan")
        elif kind == "oov_id" and out.ids:
            out.ids[0] = self.model.vocab_size + 7
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
                out.finish, out.matched = "stop", self.model.eos_ids[0]
                if out.ids and out.ids[-1] == out.matched:
                    out.matched = self.model.eos_ids[-1] + 1

    def _log(self, job: _Job, out: _Outcome | None, status: int) -> None:
        self.requests.append(
            {
                "rid": job.rid,
                "path": job.path,
                "input_ids": job.input_ids,
                "dp_rank": job.rank,
                "cache_salt": job.cache_salt,
                "pinned": job.pinned_rank is not None,
                "sampling_params": job.params,
                "fault": job.fault,
                "status": status,
                "output_ids": None if out is None else [int(t) for t in out.ids],
                "finish_reason": None if out is None else out.finish,
                "cached_tokens": None if out is None else out.cached_tokens,
                "logprobs": None if out is None else [float(x) for x in out.lps],
                "finished_s": time.monotonic(),
                "e2e_s": None if out is None else out.e2e_s,
            }
        )

    async def _pre_faults(self, request: web.Request, job: _Job) -> web.StreamResponse | None:
        """Faults that replace the whole answer; None when the request should run."""
        kind = job.fault
        if kind in ("http_500", "http_400"):
            status = 500 if kind == "http_500" else 400
            self._log(job, None, status)
            return self._error(status, f"simulated fault {kind}")
        if kind == "stall":
            self._log(job, None, 0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), timeout=3600)
            return self._error(503, "simulated stall ended by shutdown")
        if kind == "disconnect":
            self._log(job, None, 0)
            if request.transport is not None:
                request.transport.close()
            raise asyncio.CancelledError  # aiohttp drops the request without a response
        return None

    def _error(self, status: int, message: str) -> web.Response:
        if self.protocol == "sglang":
            return _json({"error": {"message": message}}, status)
        err_type = "BadRequestError" if status < 500 else "InternalServerError"
        return _json({"error": {"message": message, "type": err_type, "param": None, "code": status}}, status)

    # --- SGLang ------------------------------------------------------------------------

    def _sglang_body(self, job: _Job, out: _Outcome, final: bool) -> dict[str, Any]:
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
        ct = len(ids)
        triples = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        if final and job.fault == "length_mismatch" and triples:
            triples.pop()
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": fr,
            "prompt_tokens": out.prompt_tokens,
            "weight_version": out.weight_version if out.weight_version is not None else self.weight_version,
            "total_retractions": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": triples,
            "completion_tokens": ct,
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
        text = self.model.decode([int(t) for t in ids if not isinstance(t, bool)])
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def sglang_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
            input_ids = [int(t) for t in body["input_ids"]]
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            return self._error(400, f"invalid /generate body: {exc}")
        if isinstance(body.get("rid"), list) or (input_ids and isinstance(body["input_ids"][0], list)):
            return self._error(400, "the simulator serves single requests, not batches")
        sp = body.get("sampling_params") or {}
        rank = body.get("data_parallel_rank")
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.dp):
            return self._error(400, f"data_parallel_rank {rank} out of range [0, {self.dp})")
        job = _Job(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            input_ids=input_ids,
            max_tokens=int(sp.get("max_new_tokens", 128)),
            stop_ids=frozenset(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            top_k=int(body.get("top_logprobs_num") or 0),
            pinned_rank=rank,
            params=sp,
            path="/generate",
            fault=self._take_fault(),
            cache_salt=_salt(body.get("extra_key")),
        )
        refused = self._constrain(job, _sglang_constraint(sp))
        if refused is not None:
            return refused
        early = await self._pre_faults(request, job)
        if early is not None:
            return early
        if not body.get("stream"):
            out = await self._generate(job)
            self._apply_value_fault(job, out)
            self._log(job, out, 200)
            return _json(self._sglang_body(job, out, final=True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def frame(partial: _Outcome) -> None:
            if partial.finish == "length" and len(partial.ids) < job.max_tokens:
                data = self._sglang_body(job, partial, final=False)
                await resp.write(b"data: " + _ENCODER.encode(data) + b"\n\n")

        out = await self._generate(job, on_token=frame)
        self._apply_value_fault(job, out)
        self._log(job, out, 200)
        await resp.write(b"data: " + _ENCODER.encode(self._sglang_body(job, out, True)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def sglang_pause(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        mode = _PAUSE_MODES.get(str(body.get("mode", "abort")))
        if mode is None:
            return self._error(400, f"unknown pause mode {body.get('mode')!r}")
        self._pause(mode)
        await self._settle_aborts()
        return _json({"success": True, "message": f"Generation paused ({body.get('mode', 'abort')})."})

    async def sglang_continue(self, request: web.Request) -> web.Response:
        self._resume()
        return _json({"success": True, "message": "Generation continued."})

    async def sglang_abort(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        rid = body.get("rid")
        self.abort_calls.append({"path": "/abort_request", "body": body,
                                 "running": [j.rid for j in self.running.values()]})
        for job in list(self.running.values()):
            if body.get("abort_all") or (rid and job.rid.startswith(rid)):
                job.abort.set()
        return web.Response(status=200)

    async def sglang_model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.model.name,
                "tokenizer_path": self.model.name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "simulated",
                "architectures": ["SimulatedForCausalLM"],
                "simulated": True,
            }
        )

    async def sglang_server_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.model.name,
                "dp_size": self.dp,
                "tp_size": 1,
                "page_size": self.caches[0].page_size,
                "status": "ready",
                "max_total_num_tokens": self.caches[0].capacity_tokens,
                "internal_states": [{"dp_rank": r} for r in range(self.dp)],
                "version": "simulated",
                "simulated": True,
            }
        )

    async def sglang_load(self, request: web.Request) -> web.Response:
        return _json(
            [
                {
                    "dp_rank": r,
                    "num_reqs": sum(1 for j in self.running.values() if j.rank == r),
                    "num_waiting_reqs": 0,
                    "num_tokens": self.caches[r].used_tokens,
                }
                for r in range(self.dp)
            ]
        )

    async def sglang_flush(self, request: web.Request) -> web.Response:
        if self.running:
            return web.Response(status=400, text=_FLUSH_TEXT)
        for c in self.caches:
            c.flush()
        return web.Response(status=200, text=_FLUSH_TEXT)

    # --- vLLM --------------------------------------------------------------------------

    def _vllm_job(self, request: web.Request, body: Any, ids_key: str, path: str) -> _Job | web.Response:
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object")
        prompt = body.get(ids_key)
        if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self._error(400, f"{ids_key} must be a list of token ids (the simulator is token-in only)")
        sp = body.get("sampling_params") if ids_key == "token_ids" else body
        if not isinstance(sp, dict):
            return self._error(400, "sampling_params must be an object")
        header = request.headers.get("X-data-parallel-rank")
        rank = None
        if header is not None:
            try:
                rank = int(header)
            except ValueError:
                return self._error(400, f"bad X-data-parallel-rank {header!r}")
            if not 0 <= rank < self.dp:
                return self._error(400, f"X-data-parallel-rank {rank} out of range [0, {self.dp})")
        if body.get("stream"):
            return self._error(400, "the simulator answers vLLM requests without streaming")
        job = _Job(
            rid=str(body.get("request_id") or uuid.uuid4().hex),
            input_ids=list(prompt),
            max_tokens=int(sp.get("max_tokens") or 16),
            stop_ids=frozenset(sp.get("stop_token_ids") or ()),
            ignore_eos=bool(sp.get("ignore_eos", False)),
            top_k=int(sp.get("logprobs") or 0),
            pinned_rank=rank,
            params={k: v for k, v in sp.items() if k != ids_key},
            path=path,
            fault=self._take_fault(),
            cache_salt=_salt(body.get("cache_salt")),
        )
        refused = self._constrain(job, _vllm_constraint(sp.get("structured_outputs")))
        return job if refused is None else refused

    def _constrain(self, job: _Job, found: tuple[str, Any] | str | None) -> web.Response | None:
        """Attach the text a constraint forces; the engine's 400 when it is invalid."""
        if found is None:
            return None
        if isinstance(found, str):
            return self._error(400, found)
        if self.model.encode is None:
            return self._error(400, "this simulated model cannot follow constraints (no tokenizer)")
        try:
            job.constrained = constrained_text(*found)
        except ConstraintError as exc:
            return self._error(400, str(exc))
        return None

    def _vllm_finish(self, job: _Job, out: _Outcome) -> tuple[str, Any]:
        stop_reason = out.matched if out.finish == "stop" and out.matched in job.stop_ids else None
        return out.finish, stop_reason

    def _usage(self, out: _Outcome) -> dict[str, Any]:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.ids),
            "total_tokens": out.prompt_tokens + len(out.ids),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    async def _vllm_run(self, request: web.Request, ids_key: str, path: str) -> tuple[_Job, _Outcome] | web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return self._error(400, f"invalid JSON: {exc}")
        job = self._vllm_job(request, body, ids_key, path)
        if isinstance(job, web.Response):
            return job
        early = await self._pre_faults(request, job)
        if early is not None:
            return early
        out = await self._generate(job)
        self._apply_value_fault(job, out)
        self._log(job, out, 200)
        return job, out

    async def vllm_generate(self, request: web.Request) -> web.StreamResponse:
        run = await self._vllm_run(request, "token_ids", "/inference/v1/generate")
        if isinstance(run, web.StreamResponse):
            return run
        job, out = run
        finish, stop_reason = self._vllm_finish(job, out)
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
        return _json(
            {
                "request_id": job.rid,
                "choices": [
                    {
                        "index": 0,
                        "logprobs": {"content": content},
                        "finish_reason": finish,
                        "stop_reason": stop_reason,
                        "token_ids": out.ids,
                        "routed_experts": self.padding,
                    }
                ],
                "prompt_logprobs": None,
                "kv_transfer_params": None,
                "usage": self._usage(out),
            }
        )

    async def vllm_completions(self, request: web.Request) -> web.StreamResponse:
        run = await self._vllm_run(request, "prompt", "/v1/completions")
        if isinstance(run, web.StreamResponse):
            return run
        job, out = run
        finish, stop_reason = self._vllm_finish(job, out)
        tokens = [f"token_id:{t}" for t in out.ids]
        token_logprobs = list(out.lps)
        if job.fault == "length_mismatch" and token_logprobs:
            token_logprobs.pop()
            tokens.pop()
        pieces = [self.model.decode([int(t)]) if not isinstance(t, bool) else "" for t in out.ids]
        offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else []
        tops = (
            [{f"token_id:{a}": alp for a, alp in top} for top in out.tops]
            if out.tops
            else [{f"token_id:{t}": lp} for t, lp in zip(out.ids, out.lps, strict=True)]
        )
        return _json(
            {
                "id": f"cmpl-{job.rid}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model.name,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(pieces),
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
                        "routed_experts": self.padding,
                    }
                ],
                "usage": self._usage(out),
                "kv_transfer_params": None,
            }
        )

    async def vllm_models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "vllm",
                        "root": self.model.name,
                        "parent": None,
                        "max_model_len": self.caches[0].capacity_tokens,
                        "simulated": True,
                    }
                ],
            }
        )

    async def vllm_version(self, request: web.Request) -> web.Response:
        """`GET /version`: a release with `structured_outputs` (the fields the sim reads)."""
        return _json({"version": "0.12.0"})

    async def vllm_pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return _json({"error": f"Invalid mode {mode!r}: expected abort, wait or keep"}, 400)
        self._pause(mode)
        await self._settle_aborts()
        if request.query.get("clear_cache", "").lower() == "true":
            for c in self.caches:
                c.flush()
        return _json({"status": "paused"})

    async def vllm_resume(self, request: web.Request) -> web.Response:
        self._resume()
        return _json({"status": "resumed"})

    async def vllm_is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": self.paused is not None})

    async def vllm_abort(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw else {}
        ids = set(body.get("request_ids") or ())
        self.abort_calls.append({"path": "/abort_requests", "body": body,
                                 "running": [j.rid for j in self.running.values()]})
        for job in list(self.running.values()):
            if not ids or job.rid in ids:
                job.abort.set()
        return _json({"status": "ok"})

    async def vllm_metrics(self, request: web.Request) -> web.Response:
        name = self.model.name
        lines = [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
        ]
        for r, c in enumerate(self.caches):
            lines.append(f'vllm:prefix_cache_queries_total{{engine="{r}",model_name="{name}"}} {float(c.queries_tokens)}')
        lines += [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
        ]
        for r, c in enumerate(self.caches):
            lines.append(f'vllm:prefix_cache_hits_total{{engine="{r}",model_name="{name}"}} {float(c.hits_tokens)}')
        lines += ["# TYPE vllm:num_requests_running gauge"]
        for r in range(self.dp):
            n = sum(1 for j in self.running.values() if j.rank == r)
            lines.append(f'vllm:num_requests_running{{engine="{r}",model_name="{name}"}} {float(n)}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # --- shared ------------------------------------------------------------------------

    def _pause(self, mode: str) -> None:
        self.paused = mode
        self._resumed.clear()
        if mode == "abort":
            for job in self.running.values():
                job.abort.set()

    async def _settle_aborts(self, timeout_s: float = 5.0) -> None:
        """Answer an abort-mode pause once the aborted requests have emitted their partial
        output, as the engines do: a weight update after the pause never shows in them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(j.abort.is_set() for j in self.running.values()):
            await asyncio.sleep(0.001)

    def _resume(self) -> None:
        self.paused = None
        self._resumed.set()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def sim_faults(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
            kind, count = str(body["kind"]), int(body.get("count", 1))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            return _json({"error": f"expected {{kind, count}}: {exc}"}, 400)
        if kind not in FAULT_KINDS:
            return _json({"error": f"unknown fault kind {kind!r}; known: {list(FAULT_KINDS)}"}, 400)
        if count > 0:
            self.faults.append([kind, count])
        return _json({"pending": [[k, n] for k, n in self.faults if n > 0]})

    async def sim_aborts(self, request: web.Request) -> web.Response:
        """The abort log: every abort call received and every rid that ended aborted."""
        return _json({"calls": self.abort_calls, "aborted": self.aborted_rids})

    async def sim_faults_clear(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return _json({"pending": []})

    async def sim_requests(self, request: web.Request) -> web.Response:
        return _json(self.requests)

    async def sim_requests_clear(self, request: web.Request) -> web.Response:
        self.requests.clear()
        return _json({"cleared": True})

    async def sim_weight_version(self, request: web.Request) -> web.Response:
        """GET: the version responses report; POST {"version"}: set it (a weight update's effect)."""
        if request.method == "POST":
            try:
                body = msgspec.json.decode(await request.read())
                version = body["version"]
            except (msgspec.DecodeError, KeyError, TypeError) as exc:
                return _json({"error": f"expected {{version}}: {exc}"}, 400)
            if isinstance(version, bool) or not isinstance(version, str | int | float):
                return _json({"error": f"version must be a str or number, not {version!r}"}, 400)
            self.weight_version = str(version)
        return _json({"weight_version": self.weight_version})

    async def _on_shutdown(self, app: web.Application) -> None:
        self._closing.set()
        for job in self.running.values():
            job.abort.set()
        self._resume()

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        r.add_get("/health", self.health)
        if self.protocol == "sglang":
            r.add_post("/generate", self.sglang_generate)
            r.add_get("/health_generate", self.health)
            r.add_get("/get_model_info", self.sglang_model_info)
            r.add_get("/get_server_info", self.sglang_server_info)
            r.add_get("/server_info", self.sglang_server_info)
            r.add_get("/get_load", self.sglang_load)
            r.add_post("/abort_request", self.sglang_abort)
            r.add_post("/pause_generation", self.sglang_pause)
            r.add_post("/continue_generation", self.sglang_continue)
            r.add_post("/flush_cache", self.sglang_flush)
        else:
            r.add_post("/inference/v1/generate", self.vllm_generate)
            r.add_post("/v1/completions", self.vllm_completions)
            r.add_get("/v1/models", self.vllm_models)
            r.add_get("/version", self.vllm_version)
            r.add_post("/pause", self.vllm_pause)
            r.add_post("/resume", self.vllm_resume)
            r.add_get("/is_paused", self.vllm_is_paused)
            r.add_post("/abort_requests", self.vllm_abort)
            r.add_get("/metrics", self.vllm_metrics)
        r.add_post("/sim/faults", self.sim_faults)
        r.add_delete("/sim/faults", self.sim_faults_clear)
        r.add_get("/sim/requests", self.sim_requests)
        r.add_get("/sim/aborts", self.sim_aborts)
        r.add_get("/sim/weight_version", self.sim_weight_version)
        r.add_post("/sim/weight_version", self.sim_weight_version)
        r.add_delete("/sim/requests", self.sim_requests_clear)
        app.on_shutdown.append(self._on_shutdown)
        return app


def _sglang_constraint(sp: dict[str, Any]) -> tuple[str, Any] | str | None:
    """SGLang sampling params `json_schema` / `regex` / `ebnf`: at most one (its `verify`)."""
    found = [(k, sp[k]) for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if len(found) > 1:
        return "Only one of regex, json_schema, or ebnf can be set."
    return found[0] if found else None


_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "choice",
               "json_object": "json_object", "structural_tag": "structural_tag"}


def _vllm_constraint(so: Any) -> tuple[str, Any] | str | None:
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


def load_sim_model(tokenizer: Any) -> SimModel:
    """A SimModel from: a SimModel, "toy", a tokenizer family name (offline tokenizer),
    a tokenizer directory / hub-style path, or a loaded transformers tokenizer."""
    if isinstance(tokenizer, SimModel):
        return tokenizer
    if isinstance(tokenizer, str | Path):
        spec = str(tokenizer)
        if spec == "toy":
            from session_server.sim.toy import toy_model

            return toy_model()
        from transformers import AutoTokenizer

        path = Path(spec)
        if not path.exists():
            from session_server.sim.tokenizers import FAMILIES, cached_tokenizer_dir

            if spec in FAMILIES:
                path = cached_tokenizer_dir(spec)
        tok = AutoTokenizer.from_pretrained(str(path) if path.exists() else spec)
        return sim_model_from_tokenizer(tok, name=spec)
    return sim_model_from_tokenizer(tokenizer)


@contextlib.asynccontextmanager
async def running_sim(
    protocol: str,
    tokenizer: Any,
    *,
    seed: int = 0,
    dp: int = 1,
    latency_ms: float = 0.0,
    noncanonical: bool = False,
    padding: str | None = None,
    **engine_kwargs: Any,
) -> AsyncIterator[str]:
    """Serve a SimEngine on a free 127.0.0.1 port for the duration; yields its base URL."""
    engine = SimEngine(
        protocol, load_sim_model(tokenizer), seed=seed, dp=dp, latency_ms=latency_ms,
        noncanonical=noncanonical, padding=padding, **engine_kwargs,
    )
    runner = web.AppRunner(engine.make_app(), handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def run_sim_engine(
    protocol: str,
    tokenizer: str,
    *,
    host: str = "127.0.0.1",
    port: int,
    seed: int = 0,
    dp: int = 1,
    latency_ms: float = 0.0,
    request_latency_ms: float = 0.0,
    noncanonical: bool = False,
    padding: str | None = None,
) -> None:
    """Blocking entry for `session-server sim-engine`."""
    engine = SimEngine(
        protocol, load_sim_model(tokenizer), seed=seed, dp=dp, latency_ms=latency_ms,
        request_latency_ms=request_latency_ms, noncanonical=noncanonical, padding=padding,
    )
    web.run_app(engine.make_app(), host=host, port=port, handler_cancellation=True,
                shutdown_timeout=1.0, access_log=None)
