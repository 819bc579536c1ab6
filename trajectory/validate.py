"""Strict checks of one engine result before anything is committed.

`validate_generation` takes any object shaped like the engine seam's
`GenerateResult` (duck-typed through `GenerationLike`, so this pure library
never imports the server) plus what the caller knows about the request
(`Expectations`), and either returns a `ValidGeneration` with ids as int32 and
logprobs as float32 arrays, or raises the first `ValidationError` found, naming
the field and, for sequences, the offending index.

Checks: token ids are ints (never bools) in ``[0, vocab)``; logprobs are real
numbers (never bools), finite and ``<= 1e-6``, and not the ``-9999.0`` sentinel
some engines use for "unavailable" (unless `clamp_sentinel`: then it becomes
``SENTINEL_FLOOR`` and is counted); lengths agree with each other and with
``completion_tokens``; the echoed ids equal the ids; usage counts are ints and
consistent; the finish reason is consistent with the ids and budget; the
request id echoes; the weight version never goes backwards; when top logprobs
were asked for (``Expectations.top_logprobs = k``) and sent, there is one list
per id, each of at most ``k + 1`` ``(id, logprob)`` pairs held to the same id and
logprob rules (error index: the token; the message names the alternative).

Speed: type checks are C-level passes over the element *types*
(``list(map(type, ...)).count(int)``, then the set of distinct types), value checks are vectorised numpy; the slow per-item
loop only runs to locate an error that is already known to exist.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol, TypeGuard

import numpy as np

from trajectory.errors import ValidationError
from trajectory.line_checks import LOGPROB_MAX

LOGPROB_SENTINEL = -9999.0
SENTINEL_FLOOR = -100.0
"""What a clamped sentinel becomes: far below any plausible sampled token's logprob,
yet exp() of it is still a (subnormal) nonzero float32, so ratios stay finite."""

# `repetition`: vLLM's repetition detector ended the turn; it needs no match and says
# nothing about the budget (the turn is closed with repair tokens like any non-EOT end)
FINISH_REASONS = frozenset({"stop", "length", "abort", "repetition"})


class GenerationLike(Protocol):
    """The attributes of `session_server.engines.base.GenerateResult` that we check."""

    # read-only members (properties), so frozen dataclasses satisfy the protocol
    @property
    def request_id(self) -> Any: ...
    @property
    def output_ids(self) -> Sequence[Any]: ...
    @property
    def logprobs(self) -> Sequence[Any]: ...
    @property
    def finish_reason(self) -> Any: ...
    @property
    def matched_stop(self) -> Any: ...
    @property
    def prompt_tokens(self) -> Any: ...
    @property
    def completion_tokens(self) -> Any: ...
    @property
    def cached_tokens(self) -> Any: ...
    @property
    def weight_version(self) -> Any: ...
    @property
    def output_ids_echo(self) -> Sequence[Any] | None: ...
    # optional: `top_logprobs` (per token, a sequence of (id, logprob) pairs), read
    # with getattr so results without it (tests' fakes) still validate


@dataclass(frozen=True, slots=True)
class Expectations:
    """What the caller sent and knows, against which the result is checked."""

    request_id: str
    prompt_len: int  # number of ids sent
    vocab_size: int
    max_tokens: int  # the budget of this request (the remaining one after an abort)
    stop_token_ids: frozenset[int]  # ids that end a turn when finish is `stop` with no match
    last_weight_version: Any = None  # the session's latest version, None when unknown
    clamp_sentinel: bool = False
    top_logprobs: int = 0  # alternatives asked per token (0: none asked, none checked)


@dataclass(frozen=True, slots=True)
class ValidGeneration:
    """A result that passed every check, with normalised types."""

    request_id: str
    ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    finish_reason: str
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | int | float | None
    clamped: int  # sentinel logprobs clamped to SENTINEL_FLOOR


def is_int(v: Any) -> TypeGuard[int]:
    """A Python int that is not a bool: what a raw JSON token id or count must be
    (the engine adapters and the control plane check raw values with it too)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_type(t: type) -> bool:
    return issubclass(t, int | np.integer) and not issubclass(t, bool | np.bool_)


def _is_real_type(t: type) -> bool:
    return issubclass(t, int | float | np.integer | np.floating) and not issubclass(
        t, bool | np.bool_
    )


def _all_types(values: Sequence[Any], common: type, allowed: Any) -> bool:
    """Whether every element's exact type is allowed; one C-level pass in the common case."""
    types = list(map(type, values))
    if types.count(common) == len(types):
        return True
    return all(allowed(t) for t in set(types))


def _exact_int(value: Any, field: str) -> int:
    if not _is_int_type(type(value)):
        raise ValidationError(field, f"must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _first_index(values: Sequence[Any], bad: Any) -> int:
    for i, v in enumerate(values):
        if bad(v):
            return i
    return 0  # unreachable when the caller knows an element is bad


def _ids_array(values: Any, field: str, vocab_size: int) -> np.ndarray:
    """Ids as int64 after exact type and range checks."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValidationError(field, f"must be a flat array of ints, got dtype {values.dtype}")
        arr = values.astype(np.int64, copy=False)
    else:
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            raise ValidationError(field, f"must be a sequence of ints, got {type(values).__name__}")
        if not _all_types(values, int, _is_int_type):
            i = _first_index(values, lambda v: not _is_int_type(type(v)))
            raise ValidationError(
                field, f"must be an int, got {type(values[i]).__name__} {values[i]!r}", i
            )
        try:
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            i = _first_index(values, lambda v: not 0 <= v < vocab_size)
            raise ValidationError(field, f"{values[i]!r} is outside [0, {vocab_size})", i) from None
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValidationError(field, f"{int(arr[i])} is outside [0, {vocab_size})", i)
    return arr


def _logprobs_array(values: Any, clamp_sentinel: bool) -> tuple[np.ndarray, int]:
    field = "logprobs"
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iuf":
            raise ValidationError(
                field, f"must be a flat array of numbers, got dtype {values.dtype}"
            )
        arr = values.astype(np.float64)
    else:
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            raise ValidationError(
                field, f"must be a sequence of numbers, got {type(values).__name__}"
            )
        if not _all_types(values, float, _is_real_type):
            i = _first_index(values, lambda v: not _is_real_type(type(v)))
            raise ValidationError(
                field, f"must be a number, got {type(values[i]).__name__} {values[i]!r}", i
            )
        try:
            arr = np.array(values, dtype=np.float64)
        except OverflowError:  # an int too large for a float
            i = _first_index(values, lambda v: not -1e308 < v < 1e308)
            raise ValidationError(field, f"{values[i]!r} is not finite", i) from None
    nonfinite = ~np.isfinite(arr)
    if nonfinite.any():
        i = int(np.argmax(nonfinite))
        raise ValidationError(field, f"{arr[i]!r} is not finite", i)
    positive = arr > LOGPROB_MAX
    if positive.any():
        i = int(np.argmax(positive))
        raise ValidationError(field, f"{arr[i]!r} is above {LOGPROB_MAX}", i)
    sentinel = arr == LOGPROB_SENTINEL
    clamped = int(np.count_nonzero(sentinel))
    if clamped:
        if not clamp_sentinel:
            i = int(np.argmax(sentinel))
            raise ValidationError(
                field, f"{LOGPROB_SENTINEL} is the engine's 'unavailable' sentinel", i
            )
        arr = np.where(sentinel, SENTINEL_FLOOR, arr)
    with np.errstate(over="ignore"):  # overflow becomes inf, rejected just below
        out = arr.astype(np.float32)
    beyond = ~np.isfinite(out)  # finite float64 values below float32's range
    if beyond.any():
        i = int(np.argmax(beyond))
        raise ValidationError(field, f"{arr[i]!r} does not fit float32", i)
    return out, clamped


def _top_error(lens: list[int], flat_index: int, message: str) -> ValidationError:
    """The error for one bad alternative, located by token (index) and alternative."""
    token = int(np.searchsorted(np.cumsum(lens), flat_index, side="right"))
    alt = flat_index - sum(lens[:token])
    return ValidationError("top_logprobs", f"alternative {alt}: {message}", token)


def _is_pair(v: Any) -> bool:
    return isinstance(v, list | tuple) and len(v) == 2


def _check_top_logprobs(tops: Any, n: int, k: int, vocab_size: int) -> None:
    """Per token at most `k + 1` (id in vocab, finite logprob <= LOGPROB_MAX) pairs.

    `k + 1`: the OpenAI completions contract, which vLLM follows, adds the sampled
    token's own logprob to the `k` most likely when it is not among them. C-level
    passes over types and lengths; the slow loops only locate a known error."""
    field = "top_logprobs"
    if isinstance(tops, str | bytes) or not isinstance(tops, Sequence):
        raise ValidationError(field, f"must be a sequence per token, got {type(tops).__name__}")
    if len(tops) != n:
        raise ValidationError(field, f"{len(tops)} entries for {n} ids")
    if not _all_types(tops, list, lambda t: issubclass(t, list | tuple)):
        i = _first_index(tops, lambda e: not isinstance(e, list | tuple))
        raise ValidationError(field, f"must be a list of (id, logprob), got {tops[i]!r}", i)
    lens = list(map(len, tops))
    if lens and max(lens) > k + 1:
        i = _first_index(lens, lambda m: m > k + 1)
        raise ValidationError(field, f"{lens[i]} alternatives, {k} were asked for", i)
    flat = list(itertools.chain.from_iterable(tops))
    if not flat:
        return
    if not _all_types(flat, tuple, lambda t: issubclass(t, list | tuple)) or set(map(len, flat)) != {2}:
        j = _first_index(flat, lambda p: not _is_pair(p))
        raise _top_error(lens, j, f"must be an (id, logprob) pair, got {flat[j]!r}")
    ids, lps = list(map(itemgetter(0), flat)), list(map(itemgetter(1), flat))
    if not _all_types(ids, int, _is_int_type):
        j = _first_index(ids, lambda v: not _is_int_type(type(v)))
        raise _top_error(lens, j, f"id must be an int, got {type(ids[j]).__name__} {ids[j]!r}")
    if min(ids) < 0 or max(ids) >= vocab_size:
        j = _first_index(ids, lambda v: not 0 <= v < vocab_size)
        raise _top_error(lens, j, f"id {ids[j]!r} is outside [0, {vocab_size})")
    if not _all_types(lps, float, _is_real_type):
        j = _first_index(lps, lambda v: not _is_real_type(type(v)))
        raise _top_error(lens, j, f"logprob must be a number, got {type(lps[j]).__name__} {lps[j]!r}")
    try:
        arr = np.array(lps, dtype=np.float64)
    except OverflowError:  # an int too large for a float
        j = _first_index(lps, lambda v: not -1e308 < v < 1e308)
        raise _top_error(lens, j, f"logprob {lps[j]!r} is not finite") from None
    bad = ~np.isfinite(arr) | (arr > LOGPROB_MAX)
    if bad.any():
        j = int(np.argmax(bad))
        raise _top_error(lens, j, f"logprob {float(arr[j])!r} is not finite and <= {LOGPROB_MAX}")


def _as_number(version: Any) -> float | None:
    if isinstance(version, bool):
        return None
    if isinstance(version, int | float):
        number = float(version)
    elif isinstance(version, str):
        try:
            number = float(version.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _check_weight_version(version: Any, last: Any) -> None:
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, str | int | float):
        raise ValidationError("weight_version", f"must be a str or number, got {version!r}")
    if isinstance(version, float) and not math.isfinite(version):
        raise ValidationError("weight_version", f"must be finite, got {version!r}")
    if last is None:
        return
    new_n, last_n = _as_number(version), _as_number(last)
    # Opaque (non-numeric) versions cannot be ordered: a different one is taken as newer.
    if new_n is not None and last_n is not None and new_n < last_n:
        raise ValidationError("weight_version", f"went backwards from {last!r} to {version!r}")


def validate_generation(result: GenerationLike, expect: Expectations) -> ValidGeneration:
    """Check one engine result strictly; raise the first `ValidationError` found."""
    if not isinstance(result.request_id, str) or result.request_id != expect.request_id:
        raise ValidationError(
            "request_id", f"expected {expect.request_id!r}, got {result.request_id!r}"
        )
    # Counters an engine did not report (some vLLM versions omit `usage`) are None:
    # nothing to cross-check then, but a reported value must be exact.
    prompt_tokens = (
        expect.prompt_len
        if result.prompt_tokens is None
        else _exact_int(result.prompt_tokens, "prompt_tokens")
    )
    completion_tokens = _exact_int(result.completion_tokens, "completion_tokens")
    cached_tokens = 0 if result.cached_tokens is None else _exact_int(result.cached_tokens, "cached_tokens")

    ids = _ids_array(result.output_ids, "output_ids", expect.vocab_size)
    logprobs, clamped = _logprobs_array(result.logprobs, expect.clamp_sentinel)
    n = int(ids.shape[0])
    if logprobs.shape[0] != n:
        raise ValidationError("logprobs", f"{logprobs.shape[0]} logprobs for {n} ids")
    if completion_tokens != n:
        raise ValidationError("completion_tokens", f"is {completion_tokens}, but {n} ids came back")
    if result.output_ids_echo is not None:
        echo = _ids_array(result.output_ids_echo, "output_ids_echo", expect.vocab_size)
        m = min(n, int(echo.shape[0]))
        differ = echo[:m] != ids[:m]
        if differ.any():
            i = int(np.argmax(differ))
            raise ValidationError("output_ids_echo", f"{int(echo[i])} != {int(ids[i])}", i)
        if echo.shape[0] != n:
            raise ValidationError("output_ids_echo", f"{echo.shape[0]} echoed ids for {n} ids", m)

    if prompt_tokens != expect.prompt_len:
        raise ValidationError(
            "prompt_tokens", f"is {prompt_tokens}, but {expect.prompt_len} ids were sent"
        )
    if not 0 <= cached_tokens <= prompt_tokens:
        raise ValidationError("cached_tokens", f"{cached_tokens} is outside [0, {prompt_tokens}]")

    finish = result.finish_reason
    if finish not in FINISH_REASONS:
        raise ValidationError("finish_reason", f"unknown finish reason {finish!r}")
    if n > expect.max_tokens:
        raise ValidationError(
            "output_ids", f"{n} ids exceed max_tokens {expect.max_tokens}", expect.max_tokens
        )
    if finish == "length" and n != expect.max_tokens:
        raise ValidationError("finish_reason", f"'length' after {n} of {expect.max_tokens} tokens")
    matched = result.matched_stop
    if matched is not None and not (isinstance(matched, str) or _is_int_type(type(matched))):
        raise ValidationError("matched_stop", f"must be an int, a str or None, got {matched!r}")
    if finish == "stop":
        if matched is not None and not isinstance(matched, str):
            if n == 0 or int(ids[-1]) != int(matched):
                raise ValidationError(
                    "matched_stop", f"the ids do not end with the matched token {matched}"
                )
        elif matched is None and (n == 0 or int(ids[-1]) not in expect.stop_token_ids):
            raise ValidationError(
                "finish_reason", "'stop' without a match must end with a stop token"
            )
    _check_weight_version(result.weight_version, expect.last_weight_version)
    tops = getattr(result, "top_logprobs", None)
    if expect.top_logprobs and tops is not None:
        _check_top_logprobs(tops, n, expect.top_logprobs, expect.vocab_size)

    return ValidGeneration(
        request_id=result.request_id,
        ids=ids.astype(np.int32),
        logprobs=logprobs,
        finish_reason=finish,
        matched_stop=int(matched)
        if matched is not None and not isinstance(matched, str)
        else matched,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        weight_version=result.weight_version,
        clamped=clamped,
    )


def validate_chunk(
    ids: Sequence[Any], logprobs: Sequence[Any], top_logprobs: Sequence[Any] | None, expect: Expectations
) -> tuple[np.ndarray, np.ndarray]:
    """One streamed chunk of a generation, held to the per-token rules of a whole result
    (ids in vocab, logprobs finite, ``<= LOGPROB_MAX``, the sentinel clamped or refused,
    one logprob per id, top logprobs as asked): checked as it arrives, so that a value
    the whole result would be refused for is never shown to the agent. Returns the ids
    (int64) and logprobs (float32) as `validate_generation` would keep them."""
    arr = _ids_array(ids, "output_ids", expect.vocab_size)
    lps, _ = _logprobs_array(logprobs, expect.clamp_sentinel)
    if lps.shape[0] != arr.shape[0]:
        raise ValidationError("logprobs", f"{lps.shape[0]} logprobs for {arr.shape[0]} ids")
    if expect.top_logprobs and top_logprobs is not None:
        _check_top_logprobs(top_logprobs, int(arr.shape[0]), expect.top_logprobs, expect.vocab_size)
    return arr, lps
