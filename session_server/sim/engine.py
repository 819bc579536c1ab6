"""The simulated engine's core, with no wire format: jobs, DP ranks, prefix caches,
the generate loop, pause modes, aborts and the request log.

The wire modules (`sglang_wire`, `vllm_wire`) parse a request into a `Job`, call
`EngineCore.generate`, and shape the `Outcome` as their engine does. Token choice is
delegated to `sampler.ScriptedPolicy`; faults to `faults`.

Pause modes: `abort` (running requests return their partial output with the
engine's abort shape), `keep` (running requests freeze, continue on resume;
SGLang's `in_place`/`retract` behave so from outside), `wait` (running requests
finish); in every mode new requests are held until resume.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from session_server.sim.cache import PrefixCache
from session_server.sim.faults import FaultQueue, abort_at
from session_server.sim.job import Job, Outcome
from session_server.sim.sampler import ScriptedPolicy, SimModel

__all__ = ["PAUSE_MODES", "EngineCore"]

# the pause modes the engines name, mapped to how the core behaves
PAUSE_MODES = {"abort": "abort", "keep": "keep", "wait": "wait", "in_place": "keep", "retract": "keep"}


def stop_string_in(decode: Callable[[Sequence[int]], str], ids: Sequence[int], stops: Sequence[str]) -> str | None:
    """The first of `stops` (in the request's order) in the decoded output so far, as both
    engines match stop strings: on the output text only, never the prompt (vLLM's
    detokenizer checks `output_text` after each step, v1/engine/detokenizer.py; SGLang's
    `Req._check_str_based_finish` decodes the output's tail). Only the tail is decoded: a
    match the previous step did not see ends in the last token, and a character takes at
    most 4 byte-level tokens."""
    if not stops or not ids:
        return None
    window = 4 * max(len(s) for s in stops) + 8
    text = decode([int(t) for t in ids[-window:]])
    return next((s for s in stops if s in text), None)


class EngineCore:
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
        cache_capacity_tokens: int = 1 << 20,
        page_size: int | None = None,
        weight_version: str = "default",
        abort_plan: Sequence[int] = (),
        script: Sequence[dict[str, Any]] = (),
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        if protocol not in ("sglang", "vllm"):
            raise ValueError(f"protocol must be sglang or vllm, not {protocol!r}")
        if dp < 1:
            raise ValueError("dp must be >= 1")
        self.protocol = protocol
        self.model = model
        # vLLM's server flag `--logprobs-mode` (config/model.py `LogprobsMode`, 0.32):
        # "processed_logprobs" returns logprobs after min-p and top-k/top-p masking, a
        # masked token at -inf (its wire floor -9999.0). SGLang has no such mode: its
        # logprobs are post-temperature and untruncated (layers/sampler.py)
        self.logprobs_mode = logprobs_mode
        self.policy = ScriptedPolicy(model, seed=seed, noncanonical=noncanonical)
        if script:
            self.policy.set_script(script)
        self.dp = dp
        self.latency_ms = latency_ms
        self.request_latency_ms = request_latency_ms  # fixed per-request time (prefill/queueing)
        self.weight_version = weight_version
        ps = page_size or (1 if protocol == "sglang" else 16)
        self.caches = [PrefixCache(cache_capacity_tokens, ps) for _ in range(dp)]
        self.requests: list[dict[str, Any]] = []
        self.running: dict[str, Job] = {}
        self.faults = FaultQueue()
        self.paused: str | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.closing = asyncio.Event()
        self._rr = itertools.count()
        # per generation, in arrival order: abort right after the k-th sampled token, before
        # the stop check (SGLang checks the abort flag first, so the EOT step can be `abort`)
        self.abort_plan: list[int] = [int(k) for k in abort_plan]
        self.aborted_rids: list[str] = []  # every rid that ended with an abort, in order
        self.abort_calls: list[dict[str, Any]] = []  # every abort request received (GET /sim/aborts)
        self.held: set[str] = set()  # rids held on their stop step by the `hold_on_stop` fault

    # --- generation ------------------------------------------------------------------

    async def _wait_resumed(self, job: Job) -> None:
        waiters = [asyncio.ensure_future(self._resumed.wait()), asyncio.ensure_future(job.abort.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def generate(
        self, job: Job, on_token: Callable[[Outcome], Awaitable[None]] | None = None
    ) -> Outcome:
        """Run `job` on its rank to its end (stop, length, abort); `on_token` sees each step."""
        t0 = time.monotonic()
        self.running[job.rid] = job
        try:
            job.rank = job.pinned_rank if job.pinned_rank is not None else next(self._rr) % self.dp
            while self.paused is not None and not job.abort.is_set():
                job.waiting = True
                await self._wait_resumed(job)
            job.waiting = False
            cache = self.caches[job.rank]
            cached = cache.match(job.input_ids, job.cache_salt)
            cursor = self.policy.start(job.input_ids, job.constrained, job.seed, job.session)
            out = Outcome([], [], [] if job.top_k else None, "length", None, len(job.input_ids), cached)
            fault_at = abort_at(job.fault, self.protocol, len(cursor.planned) - cursor.offset, job.max_tokens)
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
                if fault_at is not None and i >= fault_at and job.fault == "repetition":
                    out.finish = "repetition"
                    break
                if job.abort.is_set() or (fault_at is not None and i >= fault_at):
                    out.finish, out.abort_message = "abort", "Abort in running batch."
                    break
                tok = cursor.token(i)
                out.ids.append(tok)
                spans = out.version_spans
                if spans and spans[-1][2] == self.weight_version:
                    spans[-1][1] += 1
                else:
                    spans.append([i, i + 1, self.weight_version])
                out.lps.append(cursor.logprob(i, tok))
                if out.tops is not None:
                    out.tops.append(self._top(job, cursor.top(i, tok, job.top_k)))
                job.produced = i + 1
                stop = self._stop(job, out.ids, eos)
                held = (stop is not None and job.fault == "hold_on_stop") or (
                    stop is None and job.fault == "hold_before_stop" and i + 1 < job.max_tokens
                    and self._stop(job, [*out.ids, cursor.token(i + 1)], eos) is not None)
                held = held and await self._hold(job)
                if (plan_at is not None and i + 1 >= plan_at) or held:
                    out.finish, out.abort_message = "abort", "Abort in running batch."
                    break
                if stop is not None:
                    out.finish, out.matched = "stop", stop
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

    def _top(self, job: Job, top: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """A token's top logprobs as the engine returns them: untruncated, unless vLLM
        runs with processed logprobs, where the tokens its sampler masked (rank past
        top_k, past top_p's cumulative mass, under min_p of the most likely) read
        -inf, sent as vLLM's wire floor -9999.0 (`_clamp_logprob`, 0.32). The sim's
        `top` is sorted descending with the sampled token first, so it is never masked."""
        if self.protocol != "vllm" or self.logprobs_mode != "processed_logprobs":
            return top
        p = job.params
        top_k = int(p.get("top_k") or -1)
        top_p = float(p.get("top_p") or 1.0)  # None or unset: no top-p
        min_p = float(p.get("min_p") or 0.0)
        out: list[tuple[int, float]] = []
        csum, p_max = 0.0, (math.exp(top[0][1]) if top else 0.0)
        for rank, (tid, lp) in enumerate(top):
            prob = math.exp(lp)
            csum += prob
            masked = (0 < top_k <= rank) or (top_p < 1.0 and csum - prob > top_p) or prob < min_p * p_max
            out.append((tid, -9999.0 if masked and rank else lp))
        return out

    def _stop(self, job: Job, ids: list[Any], eos: set[int]) -> int | str | None:
        """What stops `job` after `ids`: the last id (a stop id, or EOS unless ignored) or
        a stop string its output text now holds; None: it runs on."""
        tok = ids[-1]
        if tok in job.stop_ids or (not job.ignore_eos and tok in eos):
            return int(tok)
        return stop_string_in(self.model.decode, ids, job.stop_strs)

    async def _hold(self, job: Job) -> bool:
        """The `hold_on_stop` / `hold_before_stop` faults: the step that would stop `job` (or
        the one before it) waits until the engine is paused or the request aborted (a keep
        pause: until resume). True when aborted: SGLang checks the abort flag before the
        stop check, so that step reports `abort` with its token."""
        self.held.add(job.rid)
        try:
            while self.paused is None and not job.abort.is_set() and not self.closing.is_set():
                await asyncio.sleep(0.002)
            while self.paused == "keep" and not job.abort.is_set():
                await self._wait_resumed(job)
        finally:
            self.held.discard(job.rid)
        return job.abort.is_set()

    def log(self, job: Job, out: Outcome | None, status: int) -> None:
        """Append one finished request to the log `GET /sim/requests` serves."""
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
                "routed_start": job.routed_start,
                "trace_headers": job.trace_headers,
                "session": job.session,
                "status": status,
                "output_ids": None if out is None else [int(t) for t in out.ids],
                "finish_reason": None if out is None else out.finish,
                "cached_tokens": None if out is None else out.cached_tokens,
                "logprobs": None if out is None else [float(x) for x in out.lps],
                "finished_s": time.monotonic(),
                "e2e_s": None if out is None else out.e2e_s,
                # the engine's version as each token was sampled (the truth SGLang does not report)
                "version_spans": None if out is None else [list(sp) for sp in out.version_spans],
            }
        )

    # --- control ---------------------------------------------------------------------

    def abort_where(self, path: str, body: Any, match: Callable[[Job], bool]) -> None:
        """Record an abort call (for `GET /sim/aborts`) and abort the running jobs it matches."""
        self.abort_calls.append({"path": path, "body": body,
                                 "running": [j.rid for j in self.running.values()]})
        for job in list(self.running.values()):
            if match(job):
                job.abort.set()

    def set_weight_version(self, raw: bytes, *, honours_abort_all: bool) -> tuple[dict[str, Any], int]:
        """`POST /update_weight_version {"new_version"}` as both engines take it: the version
        reported from now on. SGLang (`honours_abort_all`) reads `abort_all_requests`, default
        true (its `UpdateWeightVersionReqInput`): every running request is aborted first;
        vLLM 0.32 ignores the field."""
        try:
            body = msgspec.json.decode(raw) if raw else {}
        except msgspec.DecodeError as exc:
            return {"error": f"invalid JSON: {exc}"}, 400
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return {"error": f"new_version must be a string, not {version!r}"}, 400
        abort_all = honours_abort_all and body.get("abort_all_requests", True)
        if abort_all:
            self.abort_where("/update_weight_version", body, lambda job: True)
        self.weight_version = version
        return {"success": True, "new_version": version}, 200

    def running_on(self, rank: int) -> int:
        return sum(1 for j in self.running.values() if j.rank == rank and not j.waiting)

    def waiting_on(self, rank: int) -> int:
        """Requests on `rank` not started yet (held by a pause): SGLang `num_waiting_reqs`,
        vLLM `vllm:num_requests_waiting`."""
        return sum(1 for j in self.running.values() if j.rank == rank and j.waiting)

    def pause(self, mode: str) -> None:
        self.paused = mode
        self._resumed.clear()
        if mode == "abort":
            for job in self.running.values():
                job.abort.set()

    async def settle_aborts(self, timeout_s: float = 5.0) -> None:
        """Answer an abort-mode pause once the aborted requests have emitted their partial
        output, as the engines do: a weight update after the pause never shows in them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(j.abort.is_set() for j in self.running.values()):
            await asyncio.sleep(0.001)

    def resume(self) -> None:
        self.paused = None
        self._resumed.set()

    def flush_caches(self) -> None:
        for c in self.caches:
            c.flush()

    def close(self) -> None:
        """Shutdown: end stalls, abort every running job, release paused ones."""
        self.closing.set()
        for job in self.running.values():
            job.abort.set()
        self.resume()
