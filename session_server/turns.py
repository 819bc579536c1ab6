"""The pipeline of one chat turn (DESIGN.md s3): the one place that sequences the phases.

`TurnRunner._turn` reads top to bottom as the phases, each a short method with
typed inputs and outputs, each timed under its own name (`metrics.PHASES`):

    claim (run) -> parse (offload) -> prepare (lock, offload; prepare.py) -> render (prepare.py)
      -> route + admit (_engine_request, _generate -> dispatch.py) -> generate
      -> validate (_validate, offload) -> commit (_commit, lock) -> respond (API dialect)

The claim is released in a `finally` on every path (errors, cancellation, client
disconnect), and only by the request that made it. Branch changes decided at
prepare (rollback, fork) are applied at commit, so a failed turn leaves the
session exactly as it was; `Prepared` and `Checked` are frozen values.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajectory.errors import ValidationError
from trajectory.validate import Expectations, ValidGeneration, validate_generation

from .api.models import ChatRequest, SessionSampling, parse_json_model
from .context import ServerContext, log
from .control import ResilientResult, new_request_id
from .dispatch import dispatch
from .engines.base import GenerateRequest, GenerateResult, SamplingParams
from .errors import (
    BadRequest,
    ClientGone,
    InternalInvariant,
    SessionClosed,
    UpstreamHTTPError,
    UpstreamInvalid,
)
from .prepare import Prepared, check_branch_cap, prepare, render
from .sessions import Claim, Session
from .structured import Constraint, apply_output_policy, engine_refusal


@dataclass
class TurnOutput:
    """Everything the response needs after a successful commit."""

    request_id: str
    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    sampled_ids: list[int]
    logprobs: list[float]
    top_logprobs: Sequence[Any] | None
    turn_index: int
    branch_id: int
    timings_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Checked:
    """The validated engine output, parsed as this request asked, ready to commit."""

    valid: ValidGeneration
    parsed: Any  # trajectory.codec.base.ParsedAssistant
    repair: list[int]  # tokens that close a turn the engine cut short
    message: dict[str, Any]  # the assistant message returned and stored
    finish: str  # stop | tool_calls | length | abort | repetition


class _Timer:
    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self._t0 = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._ctx.metrics.observe_phase(phase, now - self._last)
        self._last = now

    def total(self) -> None:
        self.phases["total"] = time.perf_counter() - self._t0
        self._ctx.metrics.observe_phase("total", self.phases["total"])


class TurnRunner:
    """Runs chat turns against the shared context; one instance per app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def run(
        self, session_id: str, body: bytes, client_gone: Callable[[], Coroutine[Any, Any, None]] | None = None
    ) -> tuple[ChatRequest, TurnOutput]:
        """Claim the session and run the turn as its own task, which ends early when

        - the client hangs up (`client_gone` returns): `ClientGone` (499, never sent);
        - the session is deleted (`SessionStore.close` cancels `session.turn`): 409.

        Cancelling the work aborts its engine request (`generate_resilient`) and commits
        nothing (commit has no await inside), so the claim is free at once for a retry."""
        ctx = self.ctx
        timer = _Timer(ctx)
        session, claim = ctx.store.claim(session_id)
        timer.lap("claim")
        ctx.metrics.turns_in_flight.inc()
        work = asyncio.create_task(self._turn(session, claim, body, timer), name=f"tito-turn-{session_id}")
        session.turn = work
        watcher: asyncio.Task[None] | None = None
        if client_gone is not None:
            watcher = asyncio.create_task(client_gone())
        try:
            await asyncio.wait([t for t in (work, watcher) if t is not None], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away first
                await self._cancel(work)
                self._discarded(session)
                raise ClientGone(f"client disconnected mid-turn on session {session.id}; nothing committed")
            if work.cancelled():  # only a DELETE cancels the work itself
                self._discarded(session)
                raise SessionClosed(f"session {session.id} was deleted during the turn; nothing committed")
            if isinstance(work.exception(), SessionClosed):
                self._discarded(session)
            return work.result()
        finally:
            if watcher is not None:
                watcher.cancel()
            if not work.done():  # this request itself was cancelled (e.g. shutdown)
                await self._cancel(work)
                self._discarded(session)
            if session.turn is work:
                session.turn = None
            ctx.metrics.turns_in_flight.dec()
            ctx.store.release(session, claim)

    @staticmethod
    async def _cancel(work: asyncio.Task[Any], wait_s: float = 1.0) -> None:
        """Cancel the turn's work and give its `finally`s (engine abort, routing stats) a
        bounded moment; the claim is released after this either way."""
        work.cancel()
        await asyncio.wait([work], timeout=wait_s)

    def _discarded(self, session: Session) -> None:
        """A turn that ended without a commit: counted in the session view and metrics."""
        session.turns_discarded += 1
        self.ctx.metrics.turns_total.labels(outcome="discarded").inc()

    async def _turn(
        self, session: Session, claim: Claim, body: bytes, timer: _Timer
    ) -> tuple[ChatRequest, TurnOutput]:
        ctx = self.ctx
        req: ChatRequest = await ctx.offload.run_sized(len(body), parse_json_model, body, ChatRequest)
        timer.lap("parse")
        async with session.lock:
            # O(history): the agent resends every message. Pool work (inline when
            # the body is small); the claim keeps other turns out meanwhile.
            prep = await ctx.offload.run_sized(len(body), prepare, ctx, session, req)
        timer.lap("prepare")
        prompt_ids, prep = await render(ctx, session, prep)
        timer.lap("render")
        check_branch_cap(ctx, session, prep)
        greq, expect = self._engine_request(session, req, prep, prompt_ids)
        result, target_id = await self._generate(session, req, greq, expect, timer)  # laps "route"
        timer.lap("generate")
        checked = await self._validate(result, expect, req, prep)
        timer.lap("validate")
        turn_index, branch_id = await self._commit(session, claim, prep, prompt_ids, greq, result, checked, target_id)
        timer.lap("commit")
        out = self._output(greq, result, checked, turn_index, branch_id)
        timer.total()
        out.timings_s = dict(timer.phases)
        ctx.metrics.turns_total.labels(outcome="committed").inc()
        return req, out

    # -- generate, validate, commit --

    def _sampling(self, session: Session, req: ChatRequest, constraint: Constraint | None) -> SamplingParams:
        d = SessionSampling.model_validate(session.config.sampling)  # validated at creation

        def pick(name: str) -> Any:
            v = getattr(req, name)
            return v if v is not None else getattr(d, name)

        stop = req.stop_list() or d.stop_list()
        return SamplingParams(
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=pick("seed"),
            stop=tuple(stop),
            stop_token_ids=tuple(self.ctx.codec.stop_token_ids),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            constraint=constraint,
        )

    def _budget(self, session: Session, req: ChatRequest, prompt_len: int) -> int:
        budget = req.budget() or SessionSampling.model_validate(session.config.sampling).budget() or self.ctx.settings.default_max_tokens
        limit = session.config.max_context_tokens
        if limit is not None:
            room = limit - prompt_len
            if room <= 0:
                raise BadRequest(f"context of {prompt_len} tokens reaches max_context_tokens={limit}")
            budget = min(budget, room)
        return int(budget)

    def _check_output(
        self, result: GenerateResult, expect: Expectations, req: ChatRequest, prep: Prepared
    ) -> tuple[ValidGeneration, Any, list[int]]:
        """Validate, parse (as this request: its tools, its thinking switch) and compute
        repair tokens (offload). `tool_choice: none` offers no tools to call."""
        try:
            valid = validate_generation(result, expect)
        except ValidationError as exc:
            raise UpstreamInvalid(f"engine output rejected: {exc}") from exc
        ids = valid.ids.tolist()
        tools = None if req.tool_choice == "none" else prep.tools
        parsed = self.ctx.codec.parse_assistant(ids, tools=tools, template_kwargs=prep.template_kwargs)
        repair = list(self.ctx.codec.close_turn(ids))
        return valid, parsed, repair

    # -- route + admit, generate (no lock) --

    def _engine_request(
        self, session: Session, req: ChatRequest, prep: Prepared, prompt_ids: list[int]
    ) -> tuple[GenerateRequest, Expectations]:
        """The engine request of this turn and what its output must satisfy."""
        ctx = self.ctx
        input_ids = np.concatenate([prep.context_ids, np.asarray(prompt_ids, dtype=np.int32)])
        budget = self._budget(session, req, len(input_ids))
        greq = GenerateRequest(
            request_id=new_request_id(),
            input_ids=input_ids,
            max_tokens=budget,
            sampling=self._sampling(session, req, prep.constraint),
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            lora=session.config.lora,
            timeout_s=req.timeout_s or ctx.settings.turn_timeout_s,
        )
        expect = Expectations(
            request_id=greq.request_id,
            prompt_len=len(input_ids),
            vocab_size=ctx.codec.vocab_size,
            max_tokens=budget,
            stop_token_ids=frozenset(ctx.codec.stop_token_ids),
            last_weight_version=prep.last_weight_version,
            clamp_sentinel=ctx.settings.clamp_logprob_sentinel,
            top_logprobs=greq.top_logprobs,
        )
        return greq, expect

    async def _generate(
        self, session: Session, req: ChatRequest, greq: GenerateRequest, expect: Expectations, timer: _Timer
    ) -> tuple[ResilientResult, str]:
        """Route, admit and generate; an engine's 4xx on a constraint is the client's 400."""
        try:
            return await dispatch(self.ctx, session, greq, expect, on_routed=lambda: timer.lap("route"))
        except UpstreamHTTPError as exc:
            refusal = engine_refusal(exc, greq.sampling.constraint, req)
            if refusal is not None:
                raise refusal from exc
            raise

    # -- validate (offloaded) --

    async def _validate(
        self, result: ResilientResult, expect: Expectations, req: ChatRequest, prep: Prepared
    ) -> Checked:
        ctx = self.ctx
        valid, parsed, repair = await ctx.offload.run(self._check_output, result, expect, req, prep)
        parsed = await ctx.offload.run(apply_output_policy, parsed, req, ctx.codec, valid)
        finish = valid.finish_reason
        if finish == "stop" and parsed.tool_calls:
            finish = "tool_calls"
        return Checked(valid=valid, parsed=parsed, repair=repair, message=parsed.to_message(), finish=finish)

    # -- commit (under the lock; no await inside, so a cancel never half-commits) --

    async def _commit(
        self, session: Session, claim: Claim, prep: Prepared, prompt_ids: list[int],
        greq: GenerateRequest, result: ResilientResult, checked: Checked, target_id: str,
    ) -> tuple[int, int]:
        """Apply the branch change decided at prepare and append the turn: (turn index, branch id)."""
        ctx = self.ctx
        valid, parsed = checked.valid, checked.parsed
        async with session.lock:
            ctx.store.ensure_can_commit(session, claim)  # SessionClosed: counted discarded by run()
            tree = session.tree
            if tree.active.id != prep.branch_id or len(tree.active.trajectory) != prep.base_len:
                log.error("session %s: branch moved between prepare and commit", session.id)
                raise InternalInvariant(f"session {session.id}: branch moved during the turn")
            if prep.kind == "rollback":
                tree.rollback(prep.checkpoint)
                ctx.metrics.branches_total.labels(reason="rollback").inc()
            elif prep.kind == "fork":
                if prep.fork_reason is not None:
                    session.note("fork", reason=prep.fork_reason, turn=len(tree.active.trajectory.turns),
                                 from_branch=tree.active.id)
                tree.fork(prep.fork_reason or "history_rewrite")
                ctx.metrics.branches_total.labels(reason="fork").inc()
            branch = tree.active
            if prep.kind in ("first", "rollback", "fork"):
                session.tools_by_branch[branch.id] = prep.tools
            extra: dict[str, Any] = {"request_id": greq.request_id, "parse_status": parsed.status.value}
            if parsed.status_detail:
                extra["parse_detail"] = parsed.status_detail
            if result.routed_experts is not None:
                extra["routed_experts_bytes"] = len(result.routed_experts)
            if result.aborts or result.resubmits or result.paused_wait_s:
                extra["control"] = result.counters()
                session.control_totals.add(result)
            record = branch.trajectory.commit_turn(
                prompt_ids,
                valid.ids,
                valid.logprobs,
                finish_reason=checked.finish,
                weight_spans=result.weight_spans or None,
                weight_version=None if result.weight_spans else valid.weight_version,
                repair_ids=checked.repair,
                request_messages=prep.new_messages,
                assistant_message=checked.message,
                engine=target_id,
                cached_tokens=valid.cached_tokens,
                extra=extra,
            )
            if checked.repair:
                session.note("repair", turn=record.index, tokens=len(checked.repair), finish_reason=checked.finish)
        ctx.metrics.tokens_in_total.inc(len(prompt_ids))
        ctx.metrics.tokens_out_total.inc(len(valid.ids))
        ctx.metrics.cached_tokens_total.inc(valid.cached_tokens)
        return record.index, branch.id

    @staticmethod
    def _output(
        greq: GenerateRequest, result: ResilientResult, checked: Checked, turn_index: int, branch_id: int
    ) -> TurnOutput:
        """What the respond phase (the API dialect) needs of a committed turn."""
        valid = checked.valid
        return TurnOutput(
            request_id=greq.request_id,
            message=checked.message,
            finish_reason="stop" if checked.finish == "repetition" else checked.finish,  # OpenAI knows no repetition
            prompt_tokens=len(greq.input_ids),
            completion_tokens=len(valid.ids),
            cached_tokens=valid.cached_tokens,
            sampled_ids=valid.ids.tolist(),
            logprobs=valid.logprobs.tolist(),
            top_logprobs=result.top_logprobs,
            turn_index=turn_index,
            branch_id=branch_id,
        )
