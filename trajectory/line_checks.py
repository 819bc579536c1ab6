"""The checks a linear trajectory's data must pass, kept apart from the trajectory.

`LinearTrajectory.commit_turn` is atomic: every input is checked and normalised
(ids to int32, logprobs to float32, weight spans to absolute positions) before
anything is written; `check_line` re-checks a whole line (tokens, turns,
checkpoints, message counts) on import and in tests. Both are pure functions of
plain data, so they live here and `trajectory.linear` keeps to how a line grows,
shrinks and shares its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trajectory.errors import InvariantError
from trajectory.turn_record import TurnRecord, WeightSpan, WeightVersion

LOGPROB_MAX = 1e-6
"""Largest logprob accepted (a little above 0.0 for engines' rounding noise)."""

_INT32_MAX = int(np.iinfo(np.int32).max)


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


def check_line(
    ids: np.ndarray,
    lps: np.ndarray,
    mask: np.ndarray,
    turns: Sequence[TurnRecord],
    cps: Sequence[int],
    counts: Sequence[int],
    n_messages: int,
    *,
    allow_head: bool = False,
) -> None:
    """Raise `InvariantError` unless a line's tokens (`ids`, `lps`, `mask`), its `turns`,
    checkpoints `cps`, message counts `counts` and number of messages agree
    (`LinearTrajectory.check_invariants` on the trajectory's own data).

    O(tokens) vectorised plus O(turns); meant for tests, import and debugging,
    not the per-turn path.
    """
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
    if len(cps) != len(turns) + 1 or cps[0] != 0:
        raise InvariantError(f"{len(cps)} checkpoints for {len(turns)} turns")
    if len(counts) != len(cps) or counts[0] != 0:
        raise InvariantError(f"{len(counts)} message counts for {len(cps)} checkpoints")
    for i, t in enumerate(turns):
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
    if counts[-1] != n_messages:
        raise InvariantError(f"{n_messages} messages, counts say {counts[-1]}")
