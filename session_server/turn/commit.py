"""Validate and commit: what the engine returned, checked, parsed and stored.

`validate` (O(output); offloaded unless short) checks the engine's output against the request's
`Expectations`, parses it as this request asked and computes repair tokens: a frozen
`Checked`. `commit` (under the session lock, with no await inside, so a cancel never
half-commits) applies the branch change decided at prepare and appends the turn, all
of which it reads from one `PendingTurn`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajectory.codec.base import ChatCodec, ParsedAssistant
from trajectory.errors import ValidationError
from trajectory.lineage import Lineage
from trajectory.support import SupportCSR
from trajectory.tree import NEW_CONVERSATION, ROLLBACK_REASON, Branch
from trajectory.validate import Expectations, ValidGeneration, validate_generation

from ..context import ServerContext, log
from ..control import ResilientResult
from ..engines.base import GenerateResult
from ..errors import InternalInvariant, UpstreamInvalid
from ..journal import settled
from ..journal_records import TURN, control_delta, turn_body
from ..routed import join, wire_size
from ..sessions import Claim, Session
from ..structured import apply_output_policy
from .chat_request import ChatRequest
from .engine_request import EngineCall
from .prepare import Prepared
from .support_rules import support_of

__all__ = ["Checked", "Committed", "PendingTurn", "commit", "validate"]


@dataclass(frozen=True)
class Checked:
    """The validated engine output, parsed as this request asked, ready to commit."""

    valid: ValidGeneration
    parsed: ParsedAssistant
    repair: list[int]  # tokens that close a turn the engine cut short
    message: dict[str, Any]  # the assistant message returned and stored
    finish: str  # stop | tool_calls | length | abort | repetition
    routed: np.ndarray | None = None  # routing replay: (rows, layers, topk) for [routed start, output_end - 1)
    support: SupportCSR | None = None  # sampling support asked: one row per sampled id
    extra: dict[str, Any] = field(default_factory=dict)  # more for the turn record (a live stream's notes)


@dataclass(frozen=True)
class PendingTurn:
    """A validated turn not yet stored: what the earlier phases decided (prepare's
    attachment, the prompt rendered, the engine request and its result) and the
    validated output. One value, so that `commit` cannot be handed its parts in the
    wrong order."""

    prep: Prepared
    prompt_ids: list[int]
    call: EngineCall
    result: ResilientResult
    checked: Checked
    target_id: str  # the engine that generated it
    recorded: tuple[str, bytes, str | None] | None = None  # the replay log's name of the request (journaled)
    lineage: Lineage | None = None  # which agent and thread asked (journaled with the turn)


@dataclass(frozen=True)
class Committed:
    """Where the turn was stored."""

    turn_index: int
    branch_id: int


INLINE_OUTPUT_TOKENS = 256
"""Outputs up to this many tokens (without routed experts) are checked on the loop: the
check is O(output), tens of microseconds here, less than a thread hop and its hand-back."""


INLINE_RECORD_TOKENS = 4096
"""A turn record of up to this many new tokens (without routed experts) is encoded on the
loop: well under a millisecond; a longer one (a first turn's whole prompt) off it."""


async def validate(
    ctx: ServerContext, result: ResilientResult, expect: Expectations, req: ChatRequest, prep: Prepared,
    call: EngineCall | None = None,
) -> Checked:
    """The engine output validated, parsed and shaped by the request's output policy;
    with routing replay, its routed experts decoded and gap-checked. One offload hop,
    none for a short output without routed experts."""
    routed = call is not None and (call.greq.return_routed_experts or call.support_sampling is not None)
    if not routed and len(result.output_ids) <= INLINE_OUTPUT_TOKENS:
        return _checked(ctx, result, expect, req, prep, call)
    return await ctx.offload.run(_checked, ctx, result, expect, req, prep, call)


def _checked(
    ctx: ServerContext, result: ResilientResult, expect: Expectations, req: ChatRequest, prep: Prepared,
    call: EngineCall | None,
) -> Checked:
    valid, parsed, repair, extra = _check_output(ctx, result, expect, req, prep)
    routed = None
    if call is not None and call.greq.return_routed_experts:
        routed = _routed_rows(ctx, call, result)
    support = None
    if call is not None and call.support_sampling is not None:  # aligned with the ids: tops join as they do
        support = support_of(result.top_logprobs, valid.ids, getattr(result, "support_rule", None),
                             call.support_sampling, call.greq.top_logprobs)
    parsed, message = _shaped(parsed, req, ctx.codec, valid)
    finish = valid.finish_reason
    if finish == "stop" and parsed.tool_calls:
        finish = "tool_calls"
    return Checked(valid=valid, parsed=parsed, repair=repair, message=message, finish=finish,
                   routed=routed, support=support, extra=extra)


def _shaped(parsed: ParsedAssistant, req: ChatRequest, codec: ChatCodec,
            valid: ValidGeneration) -> tuple[ParsedAssistant, dict[str, Any]]:
    """The parse shaped by the request's output policy, and the message every dialect
    renders from it, checked before commit (offload: O(output)): a dialect's response
    must not be able to fail after the turn is committed, or the client's retry (an SDK
    retries a 5xx) would commit the turn a second time. Every codec gives tool-call
    arguments as a JSON object (`ParsedToolCall`); a call that is not one would fail
    Anthropic's `tool_use.input` (an object), so it is refused here: 502, nothing
    committed."""
    parsed = apply_output_policy(parsed, req, codec, valid)
    message = parsed.to_message()
    for tc in message.get("tool_calls") or []:
        fn = tc["function"]
        try:
            args = json.loads(fn["arguments"])
        except (TypeError, ValueError):
            args = None
        if not isinstance(args, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UpstreamInvalid(
                f"the model's tool call {str(fn.get('name'))[:64]!r} parsed with arguments that are not a JSON "
                f"object ({str(fn.get('arguments'))[:80]!r}); no client dialect can carry it (nothing committed)")
    return parsed, message


def _undecodable(valid: ValidGeneration, tokenizer_size: int) -> dict[str, Any]:
    """Sampled ids in the model's vocabulary padding (rows past the tokenizer's ids): they
    are committed exactly, but no text can show them, so the turn record says where."""
    at = np.flatnonzero(valid.ids >= tokenizer_size)
    if not len(at):
        return {}
    return {"undecodable_ids": {"count": int(len(at)), "first_index": int(at[0]),
                                "ids": valid.ids[at[:8]].tolist(), "tokenizer_size": tokenizer_size}}


def _routed_rows(ctx: ServerContext, call: EngineCall, result: ResilientResult) -> np.ndarray:
    """The turn's routed experts for positions [start, input + output - 1) (offload)."""
    shape = ctx.routed_shape()
    end = len(call.greq.input_ids) + len(result.output_ids) - 1
    return join(result.routed_pieces, start=call.greq.routed_experts_start, end=end, shape=shape,
                expect=call.routed_shape)


def _check_output(
    ctx: ServerContext, result: GenerateResult, expect: Expectations, req: ChatRequest, prep: Prepared
) -> tuple[ValidGeneration, ParsedAssistant, list[int], dict[str, Any]]:
    """Validate, parse (as this request: its tools, its thinking switch), compute repair
    tokens and note ids no text shows (offload: all O(output)). `tool_choice: none` offers no tools to call."""
    try:
        valid = validate_generation(result, expect)
    except ValidationError as exc:
        raise UpstreamInvalid(f"engine output rejected: {exc}") from exc
    ids = valid.ids.tolist()
    tools = None if req.tool_choice == "none" else prep.tools
    parsed = ctx.codec.parse_assistant(ids, tools=tools, template_kwargs=prep.template_kwargs)
    repair = list(ctx.codec.close_turn(ids))
    return valid, parsed, repair, _undecodable(valid, ctx.codec.vocab_size)


async def commit(ctx: ServerContext, session: Session, claim: Claim, turn: PendingTurn) -> Committed:
    """Apply the branch change decided at prepare and append the turn."""
    prep, prompt_ids, result, checked = turn.prep, turn.prompt_ids, turn.result, turn.checked
    valid = checked.valid
    journal = ctx.journal
    async with session.lock:
        ctx.store.ensure_can_commit(session, claim)  # SessionClosed: counted discarded by run()
        if journal is not None:
            journal.check_writable()  # a full disk: 503 before anything changes
        # everything that can fail before the branch change: between a new branch and its
        # first turn only `commit_turn` runs, and `_new_branch_undone` takes the branch back when it refuses
        extra = _turn_extra(turn)
        before = session.tree.active_id
        undo = _Undo.of(session, prep) if journal is not None else None
        _apply_branch_change(ctx, session, prep)
        branch = session.tree.active
        if prep.kind in ("first", "rollback", "fork"):
            session.tools_by_branch[branch.id] = prep.tools
        with _new_branch_undone(session, branch, before, prep):
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
                engine=turn.target_id,
                cached_tokens=valid.cached_tokens,
                extra=extra,
                routed_experts=checked.routed,
                lineage=turn.lineage,
                sampling_support=checked.support,
            )
        if "control" in extra:
            session.control_totals.add(result)
        if prep.answered is not None:
            session.answered_seqs.add(prep.answered)
        if "stale_bound" in extra:
            session.note("stale_bound", turn=record.index, **extra["stale_bound"])
        if "undecodable_ids" in extra:
            session.note("undecodable_ids", turn=record.index, **extra["undecodable_ids"])
        if checked.repair:
            session.note("repair", turn=record.index, tokens=len(checked.repair), finish_reason=checked.finish)
        if journal is not None and undo is not None:
            # durable before anyone hears of it; a record that cannot be written undoes the commit
            try:
                large = checked.routed is not None or len(prompt_ids) + len(valid.ids) > INLINE_RECORD_TOKENS
                body = await _record(ctx, large,
                    op=prep.kind, branch_id=prep.branch_id, checkpoint=prep.checkpoint,
                    reason=branch.reason if prep.kind == "fork" else None, shared=prep.fork_shared,
                    tools=prep.tools if prep.kind in ("first", "rollback", "fork") else None, seq=record.seq,
                    prompt_ids=prompt_ids, ids=valid.ids, logprobs=valid.logprobs, repair=checked.repair,
                    finish=checked.finish, spans=result.weight_spans or None, version=valid.weight_version,
                    request_messages=prep.new_messages, assistant_message=checked.message, engine=turn.target_id,
                    cached=valid.cached_tokens, extra=extra, routed=checked.routed, support=checked.support,
                    answered=prep.answered, control=control_delta(undo.control, session.control_totals),
                    notes=undo.notes_added(session), recorded=turn.recorded, matched_stop=result.matched_stop,
                    lineage=turn.lineage)
                cancelled = await settled(journal.append(session.id, TURN, body))
            except BaseException:
                undo.apply(session, branch, before, prep, record)
                raise
            if cancelled:  # stored: the commit stands and the turn ends as committed (its
                # client gone or its session deleted meanwhile: the replay log keeps its answer)
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
    ctx.metrics.tokens_in_total.inc(len(prompt_ids))
    ctx.metrics.tokens_out_total.inc(len(valid.ids))
    ctx.metrics.cached_tokens_total.inc(valid.cached_tokens)
    return Committed(turn_index=record.index, branch_id=branch.id)


async def _record(ctx: ServerContext, large: bool, **fields: Any) -> bytes:
    """The turn's journal record, O(turn): encoded off the loop when large (routed
    experts: megabytes for a long turn), as `validate` does its O(output) work. A field it
    cannot encode is a bug, answered as one (500, nothing committed), never a raw error."""
    try:
        body: bytes = await ctx.offload.run(lambda: turn_body(**fields)) if large else turn_body(**fields)
    except (TypeError, ValueError, OverflowError) as exc:
        log.error("turn record not encodable: %s", exc)
        raise InternalInvariant(f"the turn could not be journaled ({exc}); nothing committed") from exc
    return body


@dataclasses.dataclass
class _Undo:
    """What a commit changes beside the tree, as it was before: a commit the journal
    could not store is taken back whole (the client gets a 503, nothing committed)."""

    control: Any
    diagnostics: tuple[int, int]  # (len, dropped) before
    tools: Any
    had_answered: bool

    @classmethod
    def of(cls, session: Session, prep: Prepared) -> _Undo:
        return cls(dataclasses.replace(session.control_totals),
                   (len(session.diagnostics), session.diagnostics_dropped),
                   session.tools_by_branch.get(prep.branch_id, _MISSING),
                   prep.answered is not None and prep.answered in session.answered_seqs)

    def _added(self, session: Session) -> int:
        n, dropped = self.diagnostics
        return len(session.diagnostics) - n + session.diagnostics_dropped - dropped

    def notes_added(self, session: Session) -> list[dict[str, Any]]:
        added = self._added(session)
        return list(session.diagnostics)[-added:] if added else []

    def apply(self, session: Session, branch: Branch, before: int, prep: Prepared, record: Any) -> None:
        """Take the commit back (the notes it added go; one that pushed an old note out of
        the bounded list does not bring it back)."""
        tree = session.tree
        branch.trajectory.rollback(record.index)
        if prep.kind in ("rollback", "fork") and branch.id != before:  # the branch it started goes too
            tree.discard(branch.id, before)
            session.tools_by_branch.pop(branch.id, None)
        else:
            if self.tools is _MISSING:
                session.tools_by_branch.pop(branch.id, None)
            else:
                session.tools_by_branch[branch.id] = self.tools
            tree.activate(before)
        tree.set_next_seq(record.seq)
        session.control_totals = self.control
        if prep.answered is not None and not self.had_answered:
            session.answered_seqs.discard(prep.answered)
        for _ in range(min(self._added(session), len(session.diagnostics))):
            session.diagnostics.pop()
        session.diagnostics_dropped = self.diagnostics[1]


_MISSING = object()


@contextlib.contextmanager
def _new_branch_undone(session: Session, branch: Branch, before: int, prep: Prepared) -> Iterator[None]:
    """Around `commit_turn` on the branch: when it refuses, a branch this commit started
    goes again (a fork sharing its parent's next prompt would otherwise keep a prompt head
    no turn opens, and an append to it would continue after that head)."""
    try:
        yield
    except Exception:
        if prep.kind in ("rollback", "fork") and branch.id != before:
            session.tree.discard(branch.id, before)
            session.tools_by_branch.pop(branch.id, None)
        raise


def _apply_branch_change(ctx: ServerContext, session: Session, prep: Prepared) -> None:
    """The attachment decided at prepare, on the branch prepare saw (checked): extend
    that branch (made active), or start a new one from it (rollback, fork)."""
    tree = session.tree
    branch = tree.get(prep.branch_id)
    if len(branch.trajectory) != prep.base_len:
        log.error("session %s: branch moved between prepare and commit", session.id)
        raise InternalInvariant(f"session {session.id}: branch moved during the turn")
    if prep.kind in ("first", "append"):
        if tree.active_id != branch.id:
            session.note("resume", branch=branch.id, from_branch=tree.active_id)
        tree.activate(branch.id)
    elif prep.kind == "rollback":
        if prep.fork_reason is not None:  # a known cause (inlined reasoning): say why it is not an append
            detail = {"detail": prep.fork_detail} if prep.fork_detail else {}
            session.note("rollback", reason=prep.fork_reason, checkpoint=prep.checkpoint,
                         from_branch=branch.id, **detail)
        tree.branch_from(branch.id, prep.checkpoint, ROLLBACK_REASON)
        ctx.metrics.branches_total.labels(reason="rollback").inc()
    elif prep.kind == "fork":
        if prep.fork_reason is not None:
            detail = {"detail": prep.fork_detail} if prep.fork_detail else {}
            session.note("fork", reason=prep.fork_reason, turn=len(branch.trajectory.turns),
                         from_branch=branch.id, checkpoint=prep.checkpoint,
                         shared_tokens=prep.fork_shared or branch.trajectory.checkpoints[prep.checkpoint], **detail)
        # a fork render decided shares the line up to where the template's render first
        # differs (prepare._fork_point); one decided at prepare starts from checkpoint 0
        tree.branch_from(branch.id, prep.checkpoint, prep.fork_reason or prep.opening or NEW_CONVERSATION,
                         shared=prep.fork_shared)
        ctx.metrics.branches_total.labels(reason="fork").inc()


def _turn_extra(turn: PendingTurn) -> dict[str, Any]:
    """The turn record's diagnostics: request id, parse status, routed-experts size and
    the control counters of a turn that lived through pauses."""
    call, result, checked, prep = turn.call, turn.result, turn.checked, turn.prep
    parsed = checked.parsed
    extra: dict[str, Any] = {"request_id": call.greq.request_id, "parse_status": parsed.status.value,
                             **checked.extra}
    if parsed.status_detail:
        extra["parse_detail"] = parsed.status_detail
    if result.routed_experts is not None:
        extra["routed_experts_bytes"] = wire_size(result.routed_experts)
    if result.aborts or result.resubmits or result.paused_wait_s:
        extra["control"] = result.counters()
    if result.aborts:  # where each abort cut the output and its resubmission went on (the viewer marks them)
        extra["segments"] = [{**m, "engine": turn.target_id} for m in result.segment_marks]
    if result.stale_bound is not None:  # ended at a weight update by max_weight_lag
        extra["stale_bound"] = result.stale_bound
    if prep.history_rewrite is not None:  # kept under the append policy
        extra["history_rewrite"] = dict(prep.history_rewrite)
    if prep.tool_call_renames:  # the client re-sent our last calls under its own ids
        extra["tool_call_id_renames"] = dict(prep.tool_call_renames)
    if call.sampling_record:  # the policy, what the engine and the client had; each segment's seed
        seeds = list(result.segment_seeds)
        extra["sampling"] = {**call.sampling_record, "seeds": seeds if any(x is not None for x in seeds) else []}
    return extra
