"""One linear token trajectory: turns, checkpoints and their invariants.

A `LinearTrajectory` is what the trainer consumes for one branch of a session:
the exact token ids the model saw and sampled, a loss mask (1 on sampled
tokens, 0 on prompt, tool output and template glue), the sampled logprobs (0.0
where the mask is 0), and one `TurnRecord` per generation with its boundaries,
finish reason and the weight version of every sampled span.

The layout of one turn inside the token stream is `trajectory.turn_record`'s
(`TurnRecord`, `WeightSpan` and `WeightVersion` live there and are re-exported
here); the checks of a turn's inputs and of a whole line are
`trajectory.line_checks`'.

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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from trajectory.buffer import TokenBuffer
from trajectory.errors import CheckpointError, InvariantError
from trajectory.line_checks import (
    _check_version,
    _int_array,
    _logprob_array,
    _normalise_spans,
    check_line,
)
from trajectory.lineage import Lineage
from trajectory.routed import RoutedRows, coverage_end
from trajectory.sent_forms import SentForms
from trajectory.support import SupportCSR
from trajectory.turn_record import Message, TurnRecord, WeightVersion, shared_extra

# public since `trajectory.linear` held it: `from trajectory.linear import WeightSpan` keeps working
from trajectory.turn_record import WeightSpan as WeightSpan

Segment = tuple[TokenBuffer, int, int]
"""Tokens ``[start, end)`` of a buffer: a prefix this trajectory shares with another."""


class LinearTrajectory:
    """A branch's tokens, mask, logprobs, turns and messages (see module doc)."""

    __slots__ = ("_buf", "_base", "_base_len", "_turns", "_checkpoints", "_messages",
                 "_message_counts", "_clock", "sent_forms")

    def __init__(self) -> None:
        self._buf = TokenBuffer()  # the tokens this trajectory added itself
        self._base: tuple[Segment, ...] = ()  # a shared prefix (fork_at), never written
        self._base_len = 0
        self._turns: list[TurnRecord] = []
        self._checkpoints: list[int] = [0]
        self._messages: list[Message] = []
        self._message_counts: list[int] = [0]
        self._clock: Callable[[], int] | None = None  # a tree's commit counter
        self.sent_forms = SentForms()  # what `history.attach` knows matches each message

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

    def _gather(self, attr: str, end: int | None, start: int = 0) -> np.ndarray:
        """`attr` of the tokens in `[start, end)`: only the segments the range overlaps are
        read (a view when it lies in one), so the cost is the range's, not `end`'s."""
        n = len(self) if end is None else max(0, min(int(end), len(self)))
        start = max(0, min(int(start), n))
        parts: list[np.ndarray] = []
        at = 0  # line position of the segment's first token
        for buf, first, stop in self.segments():
            lo, hi = max(start, at), min(n, at + stop - first)
            if lo < hi:
                parts.append(getattr(buf, attr)[first + lo - at : first + hi - at])
            at += stop - first
            if at >= n:
                break
        if len(parts) == 1:
            return parts[0]
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

    def ids_range(self, start: int, end: int) -> np.ndarray:
        """Read-only ids in `[start, end)`, O(end - start) wherever it starts on a forked line."""
        return self._gather("ids", end, start)

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
        lineage: Lineage | None = None,
        sampling_support: SupportCSR | None = None,
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
        if sampling_support is not None and len(sampling_support) != n_sampled:
            raise InvariantError(f"sampling support has {len(sampling_support)} rows for {n_sampled} sampled ids")
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
            extra=shared_extra(extra, self._turns[-1].extra if self._turns else None),
            seq=len(self._turns) if self._clock is None else self._clock(),
            routed_experts=routed,
            lineage=lineage,
            sampling_support=sampling_support,
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
        self.sent_forms.truncate(self._message_counts[checkpoint])
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
        check_line(*self.arrays(), self._turns, self._checkpoints, self._message_counts,
                   len(self._messages), allow_head=allow_head)

    def __repr__(self) -> str:
        return f"LinearTrajectory(tokens={len(self._buf)}, turns={len(self._turns)})"
