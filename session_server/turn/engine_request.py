"""The engine request of one turn: the second half of route + admit's input.

`engine_request` concatenates the committed context with the rendered prompt and
fixes what the engine is asked (budget, sampling, top logprobs, LoRA, deadline) and
what its output must satisfy (`Expectations`, checked at validate). Pure: no await,
no lock, nothing sent.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajectory.routed import coverage_end
from trajectory.validate import Expectations

from ..context import ServerContext
from ..control import new_request_id
from ..engines.base import GenerateRequest, SamplingParams, derive_seed
from ..errors import BadRequest
from ..sessions import Session
from ..structured import Constraint
from .chat_request import CLIENT_SAMPLING_FIELDS, PINNED_FIELDS, ChatRequest, SessionSampling
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
    # the turn record's `sampling`: the policy, what the engine was sent, what the client sent
    sampling_record: dict[str, Any] = field(default_factory=dict)
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
    place = _seed_place(session, prep) if session.config.seed is not None else (0, 0)  # unseeded: unused
    sampling, seed_key = _sampling(ctx, session, req, prep.constraint, place)
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0
    k = session.config.sampling_support
    if k is not None:  # the support is read out of k top logprobs; the client still sees its own
        check_turn(session.config.sampling, req, pinned=session.config.sampling_policy == "pinned")
        top_logprobs = max(top_logprobs, k)
    greq = GenerateRequest(
        request_id=request_id or new_request_id(),
        input_ids=input_ids,
        max_tokens=budget,
        sampling=sampling,
        seed_key=seed_key,
        top_logprobs=top_logprobs,
        lora=session.config.lora,
        timeout_s=req.timeout_s or ctx.settings.turn_timeout_s,
        return_routed_experts=session.config.routing_replay,
        routed_experts_start=routed_start,
        max_weight_lag=req.max_weight_lag if req.max_weight_lag is not None else session.config.max_weight_lag,
        session_id=session.id,
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
                      sampling_record=_sampling_record(session, req, greq),
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


def _seed_place(session: Session, prep: Prepared) -> tuple[int, int]:
    """(branch, turn index) the turn will be committed at: its derived seed's place. A
    rollback or fork commits on the branch `branch_from` is about to make (the next id:
    the session's claim keeps any other commit out until this one), so a resample from
    an earlier point is not handed the seed its sibling had."""
    tree = session.tree
    if prep.kind in ("first", "append"):
        return prep.branch_id, tree.get(prep.branch_id).trajectory.num_turns
    return max(b.id for b in tree.branches()) + 1, prep.checkpoint


def _sampling(ctx: ServerContext, session: Session, req: ChatRequest, constraint: Constraint | None,
              place: tuple[int, int]) -> tuple[SamplingParams, tuple[int, int, int] | None]:
    """The engine's sampling fields and, for a seeded session, the seed key its segments
    derive their seeds from. `client` policy: the request's fields, each falling back to
    the session's default. `pinned`: the distribution fields (`PINNED_FIELDS`) are the
    session's alone, unset ones left to the engine's default. The seed: a fixed seed the
    policy picked (the client's under `client`, a `sampling.seed`), else the session
    `seed`'s derivation, else none."""
    d = SessionSampling.model_validate(session.config.sampling)  # validated at creation
    pinned = session.config.sampling_policy == "pinned"

    def pick(name: str) -> Any:
        v = None if pinned and name in PINNED_FIELDS else getattr(req, name)
        return v if v is not None else getattr(d, name)

    seed, seed_key = pick("seed"), None
    if seed is None and session.config.seed is not None:
        seed_key = (session.config.seed, *place)
        seed = derive_seed(*seed_key, 0)
    stop = req.stop_list() or d.stop_list()
    return SamplingParams(
        temperature=pick("temperature"),
        top_p=pick("top_p"),
        top_k=pick("top_k"),
        min_p=pick("min_p"),
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(ctx.codec.stop_token_ids),
        presence_penalty=pick("presence_penalty"),
        frequency_penalty=pick("frequency_penalty"),
        repetition_penalty=pick("repetition_penalty"),
        constraint=constraint,
    ), seed_key


def _sampling_record(session: Session, req: ChatRequest, greq: GenerateRequest) -> dict[str, Any]:
    """What the turn record keeps of its sampling: the policy, the values the engine was
    sent (the distribution its tokens were drawn from: what a trainer recomputing
    logprobs needs), the values the client sent, and which of those did not reach the
    engine (`overridden`). The seeds each segment was sent join it at commit."""
    sent = {k: v for k in PINNED_FIELDS if (v := getattr(greq.sampling, k)) is not None}
    sent["max_tokens"] = greq.max_tokens
    client = {k: v for k in CLIENT_SAMPLING_FIELDS if (v := getattr(req, k)) is not None}
    asked = req.budget()
    overridden = [k for k in PINNED_FIELDS if k in client and sent.get(k) != client[k]]
    if asked is not None and asked != greq.max_tokens:
        overridden.append("max_tokens")
    return {"policy": session.config.sampling_policy, "engine": sent, "client": client, "overridden": overridden}


def _budget(ctx: ServerContext, session: Session, req: ChatRequest, prompt_len: int) -> int:
    """Max new tokens: the request's, else the session's, else the server's; under the
    `pinned` policy the session's is a ceiling the request may only lower; capped by
    the room left under `max_context_tokens` (none left is the client's 400)."""
    session_budget = SessionSampling.model_validate(session.config.sampling).budget()
    budget = req.budget() or session_budget or ctx.settings.default_max_tokens
    if session.config.sampling_policy == "pinned" and session_budget is not None:
        budget = min(budget, session_budget)
    limit = session.config.max_context_tokens
    if limit is not None:
        room = limit - prompt_len
        if room <= 0:
            raise BadRequest(f"context of {prompt_len} tokens reaches max_context_tokens={limit}")
        budget = min(budget, room)
    return int(budget)
