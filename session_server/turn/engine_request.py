"""The engine request of one turn: the second half of route + admit's input.

`engine_request` concatenates the committed context with the rendered prompt and
fixes what the engine is asked (budget, sampling, top logprobs, LoRA, deadline) and
what its output must satisfy (`Expectations`, checked at validate). Pure: no await,
no lock, nothing sent.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajectory.routed import coverage_end
from trajectory.validate import Expectations

from ..context import ServerContext
from ..control import new_request_id
from ..engines.base import GenerateRequest, SamplingParams
from ..errors import BadRequest
from ..sessions import Session
from ..structured import Constraint
from .chat_request import ChatRequest, SessionSampling
from .prepare import Prepared
from .support_rules import check_turn

__all__ = ["EngineCall", "engine_request"]


@dataclass(frozen=True)
class EngineCall:
    """What is sent to an engine for this turn and what its answer must satisfy."""

    greq: GenerateRequest
    expect: Expectations
    # routing replay: (layers, topk) of the branch's earlier rows, which this turn's must match
    routed_shape: tuple[int, int] | None = None
    # sampling support asked: the session's pinned sampling its supports are read with
    support_sampling: dict[str, Any] | None = None


def engine_request(
    ctx: ServerContext, session: Session, req: ChatRequest, prep: Prepared, prompt_ids: list[int],
    *, request_id: str | None = None,
) -> EngineCall:
    """The engine request of this turn (context + prompt) and what its output must satisfy;
    `request_id` when one was minted earlier (a stream that began before its turn)."""
    input_ids = np.concatenate([prep.context_ids, np.asarray(prompt_ids, dtype=np.int32)])
    routed_start, routed_shape = _replay_start(session, prep) if session.config.routing_replay else (0, None)
    budget = _budget(ctx, session, req, len(input_ids))
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0
    k = session.config.sampling_support
    if k is not None:  # the support is read out of k top logprobs; the client still sees its own
        check_turn(session.config.sampling, req)
        top_logprobs = max(top_logprobs, k)
    greq = GenerateRequest(
        request_id=request_id or new_request_id(),
        input_ids=input_ids,
        max_tokens=budget,
        sampling=_sampling(ctx, session, req, prep.constraint),
        top_logprobs=top_logprobs,
        lora=session.config.lora,
        timeout_s=req.timeout_s or ctx.settings.turn_timeout_s,
        return_routed_experts=session.config.routing_replay,
        routed_experts_start=routed_start,
        max_weight_lag=req.max_weight_lag if req.max_weight_lag is not None else session.config.max_weight_lag,
    )
    expect = Expectations(
        request_id=greq.request_id,
        prompt_len=len(input_ids),
        vocab_size=ctx.vocab_size,
        max_tokens=budget,
        stop_token_ids=frozenset(ctx.codec.stop_token_ids),
        last_weight_version=prep.last_weight_version,
        clamp_sentinel=ctx.settings.clamp_logprob_sentinel,
        top_logprobs=greq.top_logprobs,
    )
    return EngineCall(greq=greq, expect=expect, routed_shape=routed_shape,
                      support_sampling=session.config.sampling if k is not None else None)


def _replay_start(session: Session, prep: Prepared) -> tuple[int, tuple[int, int] | None]:
    """Routing replay: where this turn's rows start (the line positions the kept turns'
    rows already cover; a rollback or rewrite keeps only the turns before it) and the
    (layers, topk) those rows have. O(turns)."""
    traj = session.tree.get(prep.branch_id).trajectory
    kept = bisect_right(traj.checkpoints, len(prep.context_ids)) - 1
    turns = traj.turns[:kept] if len(prep.context_ids) else ()
    start = coverage_end(turns)
    last = next((t.routed_experts for t in reversed(turns) if t.routed_experts is not None), None)
    return start, (last.shape if last is not None and start else None)


def _sampling(ctx: ServerContext, session: Session, req: ChatRequest, constraint: Constraint | None) -> SamplingParams:
    """The request's sampling fields, each falling back to the session's default."""
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
        stop_token_ids=tuple(ctx.codec.stop_token_ids),
        presence_penalty=pick("presence_penalty"),
        frequency_penalty=pick("frequency_penalty"),
        repetition_penalty=pick("repetition_penalty"),
        constraint=constraint,
    )


def _budget(ctx: ServerContext, session: Session, req: ChatRequest, prompt_len: int) -> int:
    """Max new tokens: the request's, else the session's, else the server's; capped by
    the room left under `max_context_tokens` (none left is the client's 400)."""
    budget = req.budget() or SessionSampling.model_validate(session.config.sampling).budget() or ctx.settings.default_max_tokens
    limit = session.config.max_context_tokens
    if limit is not None:
        room = limit - prompt_len
        if room <= 0:
            raise BadRequest(f"context of {prompt_len} tokens reaches max_context_tokens={limit}")
        budget = min(budget, room)
    return int(budget)
