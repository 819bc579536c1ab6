"""One linear token trajectory: turns, checkpoints and their invariants.

A `LinearTrajectory` is what the trainer consumes for one branch of a session:
the exact token ids the model saw and sampled, a loss mask (1 on sampled
tokens, 0 on prompt, tool output and template glue), the sampled logprobs (0.0
where the mask is 0), and one `TurnRecord` per generation with its boundaries,
finish reason and the weight version of every sampled span.

Layout of one turn inside the token stream::

    prompt_start      output_start       output_end     end
    |-- prompt (mask 0) --|-- sampled (mask 1) --|-- repair (mask 0) --|

``repair`` holds the end-of-turn tokens the server appended because the model
stopped without sampling them (finish ``length``/``abort``/stop string), so the
next turn's prompt can follow a closed assistant turn.

Checkpoint 0 is the empty trajectory; checkpoint k is the position right after
turn k. `commit_turn` is atomic (all checks before any write) and costs
O(new tokens); `rollback` truncates to a checkpoint.

**Shared prefixes.** `fork_at(k)` gives a new trajectory that continues from
checkpoint k without copying a token: its first tokens are *segments*
(buffer, start, end) of the buffers it forked from, pinned there so they never
change, and only what it adds lives in its own buffer. `fork_at(k, shared=n)`
shares further, into the prompt of the turn after checkpoint k (tokens the
parent has as prompt, mask 0): those tokens open the new trajectory's next turn
(its *prompt head*), whose `commit_turn` prompt continues after them. A history
rewrite re-renders only from where the template's render first differs, so
the new branch shares everything before that point (a rewrite inside a turn's
prompt, e.g. Qwen3 dropping the generation prompt's empty think block, no
longer costs a copy of the context up to the turn). A session with B
branches therefore stores each token once (O(unique tokens)). Reading the whole
id array of a forked trajectory concatenates its segments (O(length), which
is what the engine request and the trainer pay anyway); `tail`, `len` and
`commit_turn` stay O(new tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajectory.buffer import TokenBuffer
from trajectory.errors import CheckpointError, InvariantError
from trajectory.routed import RoutedRows, coverage_end

Message = Mapping[str, Any]
WeightVersion = str | int | float | None
WeightSpan = tuple[int, int, WeightVersion]
Segment = tuple[TokenBuffer, int, int]
"""Tokens ``[start, end)`` of a buffer: a prefix this trajectory shares with another."""

LOGPROB_MAX = 1e-6
"""Largest logprob accepted (a little above 0.0 for engines' rounding noise)."""

_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One committed generation and where its tokens lie (absolute positions)."""

    index: int
    prompt_start: int
    output_start: int
    output_end: int  # end of the sampled ids
    end: int  # after the repair tokens; equals the next checkpoint
    finish_reason: str
    # (start, end, version) covering [output_start, output_end) exactly
    weight_spans: tuple[WeightSpan, ...]
    engine: str | None = None
    cached_tokens: int = 0
    repair_tokens: int = 0  # mask-0 closing tokens appended after the sampled ids
    request_messages: tuple[Message, ...] = ()  # the new messages this turn added
    assistant_message: Message | None = None  # what we returned to the agent
    extra: dict[str, Any] = field(default_factory=dict)
    # commit order across a session's branches (the tree's clock; the turn index
    # when committed outside a tree): what "later" means when picking samples
    seq: int = -1
    # routing replay (trajectory.routed): rows for positions [start, output_end - 1)
    routed_experts: RoutedRows | None = field(default=None, compare=False, repr=False)

    @property
    def weight_version(self) -> WeightVersion:
        """Version of the last sampled span (the one that finished the turn)."""
        return self.weight_spans[-1][2] if self.weight_spans else None

    @property
    def num_sampled(self) -> int:
        return self.output_end - self.output_start


def _reject_bools(values: Sequence[Any] | np.ndarray, name: str) -> None:
    """numpy silently turns a bool inside a list of numbers into 0/1: refuse that."""
    if not isinstance(values, np.ndarray) and any(
        issubclass(t, bool | np.bool_) for t in set(map(type, values))
    ):
        raise InvariantError(f"{name} contains a bool")


def _int_array(values: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """Ids as int32, rejecting bools, floats, negatives and values beyond int32."""
    _reject_bools(values, name)
    arr = np.asarray(values)
    if arr.ndim != 1:
        if arr.size == 0:
            return np.empty(0, dtype=np.int32)
        raise InvariantError(f"{name} must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise InvariantError(f"{name} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise InvariantError(f"{name}[{int(np.argmin(arr))}] is negative ({lo})")
    if hi > _INT32_MAX:
        raise InvariantError(f"{name}[{int(np.argmax(arr))}] does not fit int32 ({hi})")
    return arr.astype(np.int32, copy=False)


def _logprob_array(values: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    _reject_bools(values, "sampled_logprobs")
    arr = np.asarray(values)
    if arr.size == 0 and n == 0:
        return np.empty(0, dtype=np.float32)
    if arr.ndim != 1 or arr.dtype.kind not in "fiu":
        raise InvariantError(
            f"sampled_logprobs must be a flat sequence of numbers, got {arr.dtype}"
        )
    if arr.shape[0] != n:
        raise InvariantError(f"{arr.shape[0]} sampled_logprobs for {n} sampled_ids")
    with np.errstate(over="ignore"):  # overflow becomes inf, rejected just below
        out = arr.astype(np.float32)
    bad = ~np.isfinite(out) | (out > LOGPROB_MAX)
    if bad.any():
        i = int(np.argmax(bad))
        raise InvariantError(
            f"sampled_logprobs[{i}] = {arr[i]!r} is not a finite value <= {LOGPROB_MAX}"
        )
    return out


def _check_version(version: object) -> WeightVersion:
    if version is None or isinstance(version, str):
        return version
    if isinstance(version, bool) or not isinstance(version, int | float):
        raise InvariantError(f"weight version must be str, int, float or None, got {version!r}")
    if isinstance(version, float) and not math.isfinite(version):
        raise InvariantError(f"weight version must be finite, got {version!r}")
    return version


def _normalise_spans(
    spans: Sequence[Sequence[Any]], n_sampled: int, offset: int
) -> tuple[WeightSpan, ...]:
    """Spans relative to the sampled ids -> absolute, checking exact contiguous cover."""
    out: list[WeightSpan] = []
    pos = 0
    for i, span in enumerate(spans):
        if len(span) != 3:
            raise InvariantError(f"weight_spans[{i}] must be (start, end, version), got {span!r}")
        start, end, version = span
        if (
            isinstance(start, bool)
            or isinstance(end, bool)
            or not (isinstance(start, int | np.integer) and isinstance(end, int | np.integer))
        ):
            raise InvariantError(f"weight_spans[{i}] bounds must be ints, got {span!r}")
        if start != pos or end <= start:
            raise InvariantError(
                f"weight_spans[{i}] = {span!r} does not continue the cover at {pos} with a non-empty span"
            )
        out.append((offset + int(start), offset + int(end), _check_version(version)))
        pos = int(end)
    if pos != n_sampled:
        raise InvariantError(f"weight_spans cover [0, {pos}) but {n_sampled} tokens were sampled")
    return tuple(out)


class LinearTrajectory:
    """A branch's tokens, mask, logprobs, turns and messages (see module doc)."""

    __slots__ = ("_buf", "_base", "_base_len", "_turns", "_checkpoints", "_messages",
                 "_message_counts", "_clock")

    def __init__(self) -> None:
        self._buf = TokenBuffer()  # the tokens this trajectory added itself
        self._base: tuple[Segment, ...] = ()  # a shared prefix (fork_at), never written
        self._base_len = 0
        self._turns: list[TurnRecord] = []
        self._checkpoints: list[int] = [0]
        self._messages: list[Message] = []
        self._message_counts: list[int] = [0]
        self._clock: Callable[[], int] | None = None  # a tree's commit counter

    @classmethod
    def from_parts(
        cls, buffer: TokenBuffer, turns: Sequence[TurnRecord], *, base: Sequence[Segment] = ()
    ) -> LinearTrajectory:
        """Rebuild from stored tokens and turns (import); checks every invariant.

        `base` is a shared prefix (segments of other buffers) that precedes
        `buffer`; `turns` are all the turns, the shared ones included."""
        traj = cls()
        traj._buf = buffer
        traj._set_base(base)
        for turn in turns:
            traj._turns.append(turn)
            traj._checkpoints.append(turn.end)
            traj._messages.extend(turn.request_messages)
            if turn.assistant_message is not None:
                traj._messages.append(turn.assistant_message)
            traj._message_counts.append(len(traj._messages))
        traj.check_invariants()
        return traj

    def _set_base(self, base: Sequence[Segment]) -> None:
        for buf, start, end in base:
            if not (isinstance(buf, TokenBuffer) and 0 <= start <= end <= len(buf)):
                raise InvariantError(f"segment [{start}, {end}) is not inside its buffer")
        self._base = tuple((b, s, e) for b, s, e in base if e > s)
        self._base_len = sum(e - s for _, s, e in self._base)

    # -- reading ---------------------------------------------------------

    def __len__(self) -> int:
        return self._base_len + len(self._buf)

    @property
    def buffer(self) -> TokenBuffer:
        """The buffer of the tokens this trajectory added (all of them when unshared)."""
        return self._buf

    @property
    def shared_len(self) -> int:
        """Leading tokens shared with the trajectory this one forked from (0 when unshared)."""
        return self._base_len

    @property
    def prompt_head(self) -> int:
        """Tokens after the last checkpoint: the shared start of the next turn's prompt
        (`fork_at(k, shared=...)`), until that turn is committed; 0 otherwise."""
        return len(self) - self._checkpoints[-1]

    def segments(self) -> tuple[Segment, ...]:
        """Where every token lives: the shared prefix's segments, then the own buffer."""
        own = ((self._buf, 0, len(self._buf)),) if len(self._buf) else ()
        return self._base + own

    @property
    def nbytes(self) -> int:
        """Bytes this trajectory allocated for tokens (its own buffer; a shared prefix
        is counted where it lives)."""
        return self._buf.nbytes

    def _gather(self, attr: str, end: int | None) -> np.ndarray:
        n = len(self) if end is None else max(0, min(int(end), len(self)))
        if not self._base:
            view: np.ndarray = getattr(self._buf, attr)[:n]
            return view
        parts = []
        left = n
        for buf, start, stop in self.segments():
            if left <= 0:
                break
            take = min(stop - start, left)
            parts.append(getattr(buf, attr)[start : start + take])
            left -= take
        out = np.concatenate(parts) if parts else getattr(self._buf, attr)[:0].copy()
        out.flags.writeable = False
        return out

    @property
    def ids(self) -> np.ndarray:
        """Read-only int32 ids (a view when unshared, else one concatenation)."""
        return self._gather("ids", None)

    @property
    def logprobs(self) -> np.ndarray:
        return self._gather("logprobs", None)

    @property
    def mask(self) -> np.ndarray:
        return self._gather("mask", None)

    def arrays(self, end: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids, logprobs and mask of the tokens before `end` (read-only; O(end))."""
        return self._gather("ids", end), self._gather("logprobs", end), self._gather("mask", end)

    def ids_until(self, end: int) -> np.ndarray:
        """Read-only ids of the tokens before `end` (a view when unshared)."""
        return self._gather("ids", end)

    def tail(self, k: int) -> list[int]:
        """The last `k` token ids (what the codec needs to close a turn)."""
        own = self._buf.tail(k)
        if len(own) >= k or not self._base:
            return own
        need = k - len(own)
        out: list[int] = []
        for buf, start, stop in reversed(self._base):
            take = min(stop - start, need - len(out))
            out = buf.ids[stop - take : stop].tolist() + out
            if len(out) >= need:
                break
        return out + own

    @property
    def turns(self) -> tuple[TurnRecord, ...]:
        return tuple(self._turns)

    @property
    def num_turns(self) -> int:
        return len(self._turns)

    def turn(self, i: int) -> TurnRecord:
        """Turn `i` (no copy of the list, unlike `turns`)."""
        return self._turns[i]

    @property
    def last_turn(self) -> TurnRecord | None:
        return self._turns[-1] if self._turns else None

    @property
    def checkpoints(self) -> tuple[int, ...]:
        """Token position of each checkpoint: [0, end of turn 1, ..., end of turn n]."""
        return tuple(self._checkpoints)

    @property
    def checkpoint_message_counts(self) -> tuple[int, ...]:
        """Number of messages in `messages()` at each checkpoint (for `history.reconcile`)."""
        return tuple(self._message_counts)

    def message_counts_view(self) -> Sequence[int]:
        """`checkpoint_message_counts` without the copy, for per-turn readers that only
        look (`history.attach` bisects it for every branch): do not mutate."""
        return self._message_counts

    def messages(self) -> list[Message]:
        """Committed history: per turn, its request messages then its assistant message."""
        return list(self._messages)

    def message(self, i: int) -> Message:
        """Message `i` of the committed history (no copy of the list)."""
        return self._messages[i]

    @property
    def num_messages(self) -> int:
        return len(self._messages)

    # -- writing ---------------------------------------------------------

    def commit_turn(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampled_ids: Sequence[int] | np.ndarray,
        sampled_logprobs: Sequence[float] | np.ndarray,
        *,
        finish_reason: str,
        weight_spans: Sequence[Sequence[Any]] | None = None,
        weight_version: WeightVersion = None,
        repair_ids: Sequence[int] | np.ndarray = (),
        request_messages: Sequence[Message] = (),
        assistant_message: Message | None = None,
        engine: str | None = None,
        cached_tokens: int = 0,
        extra: Mapping[str, Any] | None = None,
        routed_experts: np.ndarray | None = None,
    ) -> TurnRecord:
        """Append one turn atomically and add the checkpoint after it.

        The turn's prompt is the prompt head (`prompt_head`, a fork's shared tokens;
        usually none) followed by `prompt_ids`.

        `routed_experts` (routing replay) are the engine's rows for line positions
        ``[routed_start(), output_end - 1)``, shape ``(rows, layers, topk)``: they
        must continue the earlier turns' rows exactly, with their layers and topk.

        `weight_spans` are ``(start, end, version)`` *relative to the sampled ids*
        (0..len(sampled_ids)), contiguous and non-empty; they are stored as
        absolute positions. Without them the whole output gets `weight_version`.
        Any invalid input raises `InvariantError` and changes nothing.
        """
        prompt = _int_array(prompt_ids, "prompt_ids")
        sampled = _int_array(sampled_ids, "sampled_ids")
        repair = _int_array(repair_ids, "repair_ids")
        n_sampled = int(sampled.shape[0])
        logprobs = _logprob_array(sampled_logprobs, n_sampled)
        if not isinstance(finish_reason, str) or not finish_reason:
            raise InvariantError(f"finish_reason must be a non-empty str, got {finish_reason!r}")
        if (
            isinstance(cached_tokens, bool)
            or not isinstance(cached_tokens, int | np.integer)
            or cached_tokens < 0
        ):
            raise InvariantError(f"cached_tokens must be an int >= 0, got {cached_tokens!r}")
        if engine is not None and not isinstance(engine, str):
            raise InvariantError(f"engine must be a str or None, got {engine!r}")

        prompt_start = self._checkpoints[-1]  # a fork's prompt head (fork_at) opens the prompt
        output_start = len(self) + int(prompt.shape[0])
        output_end = output_start + n_sampled
        end = output_end + int(repair.shape[0])
        if weight_spans is not None:
            if weight_version is not None:
                raise InvariantError("give weight_spans or weight_version, not both")
            spans = _normalise_spans(weight_spans, n_sampled, output_start)
        elif n_sampled:
            spans = ((output_start, output_end, _check_version(weight_version)),)
        else:
            spans = ()
        routed = self._checked_routed(routed_experts, output_end)
        request = tuple(request_messages)
        turn = TurnRecord(
            index=len(self._turns),
            prompt_start=prompt_start,
            output_start=output_start,
            output_end=output_end,
            end=end,
            finish_reason=finish_reason,
            weight_spans=spans,
            engine=engine,
            cached_tokens=int(cached_tokens),
            repair_tokens=int(repair.shape[0]),
            request_messages=request,
            assistant_message=assistant_message,
            extra=dict(extra) if extra else {},
            seq=len(self._turns) if self._clock is None else self._clock(),
            routed_experts=routed,
        )

        ids = np.concatenate((prompt, sampled, repair))
        lps = np.zeros(ids.shape[0], dtype=np.float32)
        at = int(prompt.shape[0])
        lps[at : at + n_sampled] = logprobs
        mask = np.zeros(ids.shape[0], dtype=np.uint8)
        mask[at : at + n_sampled] = 1
        self._buf.append(ids, lps, mask)

        self._turns.append(turn)
        self._checkpoints.append(end)
        self._messages.extend(request)
        if assistant_message is not None:
            self._messages.append(assistant_message)
        self._message_counts.append(len(self._messages))
        return turn

    def routed_start(self) -> int:
        """Where the next turn's routed-experts rows start: the line positions the
        committed turns' rows cover from 0 (`trajectory.routed.coverage_end`)."""
        return coverage_end(self._turns)

    def _checked_routed(self, rows: np.ndarray | None, output_end: int) -> RoutedRows | None:
        """The turn's rows, checked to continue the line's rows exactly (no write)."""
        if rows is None:
            return None
        start = self.routed_start()
        out = RoutedRows(start, np.asarray(rows))
        if out.end != max(start, output_end - 1):
            raise InvariantError(
                f"routed experts cover [{start}, {out.end}), the turn needs [{start}, {output_end - 1})"
            )
        prev = next((t.routed_experts for t in reversed(self._turns) if t.routed_experts is not None), None)
        if prev is not None and start and prev.shape != out.shape:
            raise InvariantError(f"routed experts of shape {out.shape}, earlier turns have {prev.shape}")
        return out

    def rollback(self, checkpoint: int) -> None:
        """Truncate tokens, turns and messages back to `checkpoint` (never below a
        prefix another branch shares: that raises and changes nothing)."""
        self._check_checkpoint(checkpoint)
        n = self._checkpoints[checkpoint]
        if n >= self._base_len:
            self._buf.truncate(n - self._base_len)
        else:
            self._buf.truncate(0)
            self._set_base(self._prefix_segments(n))
        del self._turns[checkpoint:]
        del self._checkpoints[checkpoint + 1 :]
        del self._messages[self._message_counts[checkpoint] :]
        del self._message_counts[checkpoint + 1 :]

    def _prefix_segments(self, n: int) -> list[Segment]:
        out: list[Segment] = []
        left = n
        for buf, start, stop in self.segments():
            if left <= 0:
                break
            take = min(stop - start, left)
            out.append((buf, start, start + take))
            left -= take
        return out

    def fork_at(self, checkpoint: int, shared: int | None = None) -> LinearTrajectory:
        """A new trajectory equal to this one rolled back to `checkpoint`, sharing its
        tokens instead of copying them (O(turns + segments), no token copied). The
        shared tokens are pinned: this trajectory can no longer roll back below them.

        `shared` (default: the checkpoint's position) may reach past the checkpoint into
        the prompt of the next turn, up to its first sampled token: those prompt tokens
        become the new trajectory's prompt head, the start of its next turn's prompt
        (`commit_turn` appends the rest of that prompt after them)."""
        self._check_checkpoint(checkpoint)
        n = self._checkpoints[checkpoint]
        if shared is not None:
            limit = self._turns[checkpoint].output_start if checkpoint < len(self._turns) else n
            if isinstance(shared, bool) or not isinstance(shared, int | np.integer) or not n <= shared <= limit:
                raise CheckpointError(
                    f"cannot share {shared!r} tokens from checkpoint {checkpoint}: "
                    f"the prompt after it spans [{n}, {limit}]"
                )
            n = int(shared)
        out = LinearTrajectory()
        out._set_base(self._prefix_segments(n))
        if n > self._base_len:
            self._buf.pin(n - self._base_len)
        out._turns = self._turns[:checkpoint]
        out._checkpoints = self._checkpoints[: checkpoint + 1]
        out._message_counts = self._message_counts[: checkpoint + 1]
        out._messages = self._messages[: out._message_counts[-1]]
        out._clock = self._clock
        return out

    def _check_checkpoint(self, checkpoint: int) -> None:
        if (
            isinstance(checkpoint, bool)
            or not isinstance(checkpoint, int | np.integer)
            or not 0 <= checkpoint <= len(self._turns)
        ):
            raise CheckpointError(
                f"unknown checkpoint {checkpoint!r}: this trajectory has checkpoints 0..{len(self._turns)}"
            )

    # -- invariants ------------------------------------------------------

    def check_invariants(self, *, allow_head: bool = False) -> None:
        """Raise `InvariantError` unless tokens, turns, checkpoints and messages agree
        (`allow_head`: a fresh fork's shared prompt head, before its first turn, is valid).

        O(tokens) vectorised plus O(turns); meant for tests, import and debugging,
        not the per-turn path.
        """
        ids, lps, mask = self.arrays()
        n = ids.shape[0]
        if not (lps.shape[0] == mask.shape[0] == n):
            raise InvariantError("ids, logprobs and mask differ in length")
        if n:
            if int(ids.min()) < 0:
                raise InvariantError(f"ids[{int(np.argmin(ids))}] is negative")
            if int(mask.max()) > 1:
                raise InvariantError(f"mask[{int(np.argmax(mask > 1))}] is not 0 or 1")
            off = (mask == 0) & (lps != 0.0)
            if off.any():
                raise InvariantError(f"logprobs[{int(np.argmax(off))}] is not 0.0 where mask is 0")
            bad = (mask == 1) & (~np.isfinite(lps) | (lps > LOGPROB_MAX))
            if bad.any():
                raise InvariantError(
                    f"logprobs[{int(np.argmax(bad))}] is not a valid sampled logprob"
                )
        cps, counts = self._checkpoints, self._message_counts
        if len(cps) != len(self._turns) + 1 or cps[0] != 0:
            raise InvariantError(f"{len(cps)} checkpoints for {len(self._turns)} turns")
        if len(counts) != len(cps) or counts[0] != 0:
            raise InvariantError(f"{len(counts)} message counts for {len(cps)} checkpoints")
        for i, t in enumerate(self._turns):
            where = f"turn {i}"
            if t.index != i:
                raise InvariantError(f"{where} has index {t.index}")
            if t.prompt_start != cps[i] or t.end != cps[i + 1]:
                raise InvariantError(
                    f"{where} [{t.prompt_start}, {t.end}) is not [{cps[i]}, {cps[i + 1]})"
                )
            if not (t.prompt_start <= t.output_start <= t.output_end <= t.end <= n):
                raise InvariantError(f"{where} boundaries are not monotone within {n} tokens")
            if t.repair_tokens != t.end - t.output_end:
                raise InvariantError(
                    f"{where} records {t.repair_tokens} repair tokens, has {t.end - t.output_end}"
                )
            if mask[t.prompt_start : t.output_start].any() or mask[t.output_end : t.end].any():
                raise InvariantError(f"{where} has mask 1 outside its sampled ids")
            if not mask[t.output_start : t.output_end].all():
                raise InvariantError(f"{where} has mask 0 inside its sampled ids")
            r = t.routed_experts
            if r is not None and r.end != max(r.start, t.output_end - 1):
                raise InvariantError(f"{where} routed experts end at {r.end}, output at {t.output_end}")
            pos = t.output_start
            for s, e, _ in t.weight_spans:
                if s != pos or e <= s:
                    raise InvariantError(
                        f"{where} weight spans do not cover its output contiguously"
                    )
                pos = e
            if pos != t.output_end:
                raise InvariantError(f"{where} weight spans end at {pos}, output at {t.output_end}")
            added = len(t.request_messages) + (t.assistant_message is not None)
            if counts[i + 1] != counts[i] + added:
                raise InvariantError(
                    f"{where} adds {added} messages, counts say {counts[i + 1] - counts[i]}"
                )
        if not cps[-1] <= n:
            raise InvariantError(f"last checkpoint {cps[-1]} is past the length {n}")
        if mask[cps[-1] :].any():
            raise InvariantError(f"the prompt head after the last checkpoint {cps[-1]} has mask 1")
        if cps[-1] != n and not allow_head:
            # a prompt head exists only between a fork and its first commit (under the
            # session's lock); anywhere else (an import, a tree at rest) it is tokens no
            # turn holds, which the next commit would take into its prompt
            raise InvariantError(f"{n - cps[-1]} tokens after the last checkpoint {cps[-1]} belong to no turn")
        if counts[-1] != len(self._messages):
            raise InvariantError(f"{len(self._messages)} messages, counts say {counts[-1]}")

    def __repr__(self) -> str:
        return f"LinearTrajectory(tokens={len(self._buf)}, turns={len(self._turns)})"
