"""Compact, append-only token storage: the bytes behind every trajectory.

A `TokenBuffer` holds three parallel numpy arrays: token ids (int32),
log-probabilities (float32) and the loss mask (uint8), 9 bytes per token.
Appends are amortised O(1) per token (geometric growth by 1.25x), so capacity
never exceeds 1.25x the stored length and the allocation stays below
``BYTES_PER_TOKEN_BOUND`` (12) bytes per stored token including slack. There are
no per-token Python objects; readers get read-only views of the used length.

The buffer is deliberately dumb: it checks shapes, not meaning. What a mask or
a logprob may be is `trajectory.line_checks`' business (what a committed line accepts).

A buffer can be *shared*: a branch forked from a trajectory references the
first ``n`` tokens of its parent's buffer instead of copying them, and `pin(n)`
records that. The stored tokens below the pin never change again (`truncate`
below it raises), which is what makes the reference safe. Readers always go
through the buffer object, never a numpy view kept across appends: a view
would keep an outgrown allocation alive and double the memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trajectory.errors import InvariantError

IDS_DTYPE = np.dtype(np.int32)
LOGPROBS_DTYPE = np.dtype(np.float32)
MASK_DTYPE = np.dtype(np.uint8)
GROWTH_FACTOR = 1.25
BYTES_PER_TOKEN_BOUND = 12.0  # 9 bytes of payload x 1.25 slack = 11.25 < 12

_ITEM_BYTES = IDS_DTYPE.itemsize + LOGPROBS_DTYPE.itemsize + MASK_DTYPE.itemsize


def _readonly(view: np.ndarray) -> np.ndarray:
    view.flags.writeable = False
    return view


class TokenBuffer:
    """Append-only ids/logprobs/mask storage with truncation for rollback."""

    __slots__ = ("_ids", "_logprobs", "_mask", "_len", "_pinned")

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise InvariantError(f"capacity must be >= 0, got {capacity}")
        self._ids = np.empty(capacity, dtype=IDS_DTYPE)
        self._logprobs = np.empty(capacity, dtype=LOGPROBS_DTYPE)
        self._mask = np.empty(capacity, dtype=MASK_DTYPE)
        self._len = 0
        self._pinned = 0  # tokens below this are referenced by another trajectory

    @classmethod
    def from_arrays(
        cls,
        ids: np.ndarray | Sequence[int],
        logprobs: np.ndarray | Sequence[float],
        mask: np.ndarray | Sequence[int],
    ) -> TokenBuffer:
        """A buffer holding exactly these arrays (copied, exact capacity)."""
        ids_arr = np.asarray(ids)
        buf = cls(int(ids_arr.shape[0]) if ids_arr.ndim == 1 else 0)
        buf.append(ids_arr, logprobs, mask)
        return buf

    def __len__(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        """Tokens the current allocation can hold without growing."""
        return int(self._ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the three arrays, slack included."""
        return int(self._ids.nbytes + self._logprobs.nbytes + self._mask.nbytes)

    def bytes_per_token(self) -> float:
        """Allocated bytes per stored token (0.0 when nothing is allocated, inf when empty)."""
        if self._len == 0:
            return 0.0 if self.nbytes == 0 else float("inf")
        return self.nbytes / self._len

    @property
    def ids(self) -> np.ndarray:
        """Read-only int32 view of the stored ids."""
        return _readonly(self._ids[: self._len])

    @property
    def logprobs(self) -> np.ndarray:
        """Read-only float32 view of the stored logprobs."""
        return _readonly(self._logprobs[: self._len])

    @property
    def mask(self) -> np.ndarray:
        """Read-only uint8 view of the stored loss mask."""
        return _readonly(self._mask[: self._len])

    def _reserve(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, int(cap * GROWTH_FACTOR))
        self._realloc(new_cap)

    def _realloc(self, new_cap: int) -> None:
        n = self._len
        for name, dtype in (
            ("_ids", IDS_DTYPE),
            ("_logprobs", LOGPROBS_DTYPE),
            ("_mask", MASK_DTYPE),
        ):
            fresh = np.empty(new_cap, dtype=dtype)
            fresh[:n] = getattr(self, name)[:n]
            setattr(self, name, fresh)

    def append(
        self,
        ids: np.ndarray | Sequence[int],
        logprobs: np.ndarray | Sequence[float] | None = None,
        mask: np.ndarray | Sequence[int] | int = 0,
    ) -> None:
        """Append a batch of tokens; `logprobs` None means 0.0, `mask` may be a scalar.

        All-or-nothing: shapes are checked before anything is written.
        """
        ids_arr = np.asarray(ids)
        if ids_arr.ndim != 1:
            raise InvariantError(f"ids must be 1-D, got shape {ids_arr.shape}")
        k = int(ids_arr.shape[0])
        lp_arr = None
        if logprobs is not None:
            lp_arr = np.asarray(logprobs)
            if lp_arr.shape != (k,):
                raise InvariantError(
                    f"{lp_arr.shape[0] if lp_arr.ndim else 0} logprobs for {k} ids"
                )
        mask_arr = np.asarray(mask)
        if mask_arr.ndim != 0 and mask_arr.shape != (k,):
            raise InvariantError(f"mask of shape {mask_arr.shape} for {k} ids")
        if k == 0:
            return
        start, end = self._len, self._len + k
        self._reserve(end)
        self._ids[start:end] = ids_arr
        if lp_arr is None:
            self._logprobs[start:end] = 0.0
        else:
            self._logprobs[start:end] = lp_arr
        self._mask[start:end] = mask_arr
        self._len = end

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens (rollback).

        Shrinks the allocation when the slack would exceed the growth bound, so
        `bytes_per_token()` stays bounded after a rollback too (one O(n) copy;
        rollbacks are rare).
        """
        if not 0 <= n <= self._len:
            raise InvariantError(f"cannot truncate {self._len} tokens to {n}")
        if n < self._pinned:
            raise InvariantError(
                f"cannot truncate to {n} tokens: the first {self._pinned} are shared with a branch"
            )
        self._len = n
        if self.capacity > int(n * GROWTH_FACTOR):
            self._realloc(n)

    @property
    def pinned(self) -> int:
        """How many leading tokens another trajectory references (they never change)."""
        return self._pinned

    def pin(self, n: int) -> None:
        """Promise the first `n` tokens never change: another trajectory shares them."""
        if not 0 <= n <= self._len:
            raise InvariantError(f"cannot pin {n} tokens of {self._len}")
        self._pinned = max(self._pinned, n)

    def tail(self, k: int) -> list[int]:
        """The last `k` ids (fewer when shorter) as Python ints."""
        if k <= 0:
            return []
        return self._ids[max(0, self._len - k) : self._len].tolist()

    def copy_prefix(self, n: int) -> TokenBuffer:
        """A new buffer holding a copy of the first `n` tokens (exact capacity)."""
        if not 0 <= n <= self._len:
            raise InvariantError(f"prefix of {n} tokens out of range 0..{self._len}")
        out = TokenBuffer(n)
        out._ids[:n] = self._ids[:n]
        out._logprobs[:n] = self._logprobs[:n]
        out._mask[:n] = self._mask[:n]
        out._len = n
        return out

    def __repr__(self) -> str:
        return f"TokenBuffer(len={self._len}, capacity={self.capacity})"
