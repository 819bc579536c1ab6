"""Sampling support: per sampled token, the set of ids the sampler could draw after
top-k / top-p / min-p truncation, so a trainer can rebuild the exact sampling
distribution (miles' `rollout_sampling_mask_ids` / `_offsets`, SkyRL's sampling mask).

Stored compactly as CSR: `ids` (int32, every token's support one after another) and
`offsets` (int32, ``len(tokens) + 1``; token ``i`` owns ``ids[offsets[i]:offsets[i+1]]``).
A support holds at most ``k`` ids, so a token costs at most ``4 * k + 4`` bytes.

Engines do not send the support itself here; it is read out of the per-token top-k
logprobs each engine returns, by one of two rules (the adapter declares which):

- ``processed``: vLLM started with ``--logprobs-mode processed_logprobs`` returns
  logprobs after temperature, min-p and top-k/top-p masking; a masked token's logprob
  is ``-inf``, which vLLM's generate endpoint clamps to ``-9999.0`` on the wire
  (``entrypoints/scale_out/token_in_token_out/serving.py: _clamp_logprob``, 0.32).
  The support is the returned ids above that floor.
- ``post_temperature``: SGLang returns ``log(softmax(logits / T))`` over the whole
  vocabulary, before truncation (``layers/sampler.py``: ``logprobs = log(probs)``,
  unless ``SGLANG_RETURN_ORIGINAL_LOGPROB``). The support is rebuilt from the sorted
  top-k by SGLang's own torch rule (``top_k_top_p_min_p_sampling_from_probs_torch``):
  rank < top_k, then ``cumsum - p <= top_p`` on the unrenormalised sorted probs, then
  ``p >= min_p * p_max``. Exact because the probs are normalised over the vocabulary.

Either way the sampled token must lie in its support and the support must hold at most
``top_k`` ids (more only where they tie with the top_k-th, as vLLM keeps ties) and fewer
than the top logprobs asked: anything else is bad engine output (`ValidationError`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from trajectory.errors import InvariantError, ValidationError

SupportRule = Literal["processed", "post_temperature"]
PROCESSED_FLOOR = -9999.0  # vLLM's wire floor for -inf; a masked token is at or below it
MAX_SUPPORT_K = 20  # vLLM's default `--max-logprobs`: the most top logprobs one token may ask


@dataclass(frozen=True, slots=True)
class SupportCSR:
    """Every token's support as CSR (see module doc); `offsets[0] == 0`."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int32, len(tokens) + 1

    def __post_init__(self) -> None:
        ids, off = self.ids, self.offsets
        if ids.dtype != np.int32 or off.dtype != np.int32 or ids.ndim != 1 or off.ndim != 1:
            raise InvariantError("support ids and offsets must be 1-D int32")
        if off.shape[0] < 1 or int(off[0]) != 0 or int(off[-1]) != ids.shape[0] or (np.diff(off) < 0).any():
            raise InvariantError(f"support offsets {off[:4]!r}... do not index {ids.shape[0]} ids")

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.offsets.nbytes)

    def row(self, i: int) -> np.ndarray:
        return self.ids[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def to_lists(self) -> list[list[int]]:
        return [self.row(i).tolist() for i in range(len(self))]

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> SupportCSR:
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        off = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(lens, out=off[1:])
        ids = np.fromiter((i for r in rows for i in r), dtype=np.int32, count=int(lens.sum()))
        return cls(ids, off)

    @classmethod
    def empty(cls) -> SupportCSR:
        return cls(np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int32))

    def slice(self, start: int, end: int) -> SupportCSR:
        """Tokens [start, end) as their own CSR (offsets rebased to 0)."""
        a, b = int(self.offsets[start]), int(self.offsets[end])
        return SupportCSR(self.ids[a:b].copy(), (self.offsets[start : end + 1] - a).astype(np.int32))


def concat(parts: Sequence[SupportCSR]) -> SupportCSR:
    """The supports of consecutive token runs as one CSR (a turn's segments joined)."""
    if not parts:
        return SupportCSR.empty()
    ids = np.concatenate([p.ids for p in parts]).astype(np.int32, copy=False)
    offs = [np.zeros(1, dtype=np.int64)]
    base = 0
    for p in parts:
        offs.append(p.offsets[1:].astype(np.int64) + base)
        base += int(p.ids.shape[0])
    return SupportCSR(ids, np.concatenate(offs).astype(np.int32))


@dataclass(frozen=True, slots=True)
class SupportSampling:
    """The truncation a session pinned, which the `post_temperature` rule replays."""

    top_k: int
    top_p: float = 1.0
    min_p: float = 0.0


def _row(pairs: Any, rule: SupportRule, s: SupportSampling) -> list[tuple[int, float]]:
    """The support of one token, (id, logprob) most likely first."""
    ordered = sorted(((int(t[0]), float(t[1])) for t in pairs), key=lambda t: -t[1])
    seen: set[int] = set()
    uniq = [(i, lp) for i, lp in ordered if not (i in seen or seen.add(i))]  # type: ignore[func-returns-value]
    if rule == "processed":
        return [(i, lp) for i, lp in uniq if lp > PROCESSED_FLOOR and math.isfinite(lp)]
    out: list[tuple[int, float]] = []
    csum = 0.0
    p_max = math.exp(uniq[0][1]) if uniq else 0.0
    for i, lp in uniq[: s.top_k]:
        p = math.exp(lp)
        csum += p
        if s.top_p < 1.0 and csum - p > s.top_p:  # top_p 1.0: no top-p (both engines skip it)
            break
        if p < s.min_p * p_max:
            break
        out.append((i, lp))
    return out


def _check_size(row: list[tuple[int, float]], top_k: int, asked: int, n: int) -> None:
    """At most top_k ids, but for ties: vLLM's top-k keeps every logit equal to the
    k-th (`apply_top_k_only`: ``logits < kth`` masked), and bf16 logits tie often, so
    ids past top_k must tie with the top_k-th; else the logprobs were not processed
    (vLLM's default raw mode). A support that fills all `asked` top logprobs past
    top_k may go on beyond them: it cannot be captured whole."""
    if len(row) <= top_k:
        return
    if any(lp != row[top_k - 1][1] for _, lp in row[top_k:]):
        raise ValidationError(
            "sampling_support", f"support of {len(row)} ids is larger than top_k={top_k}"
            " (is vLLM started with --logprobs-mode processed_logprobs?)", n)
    if len(row) >= asked:
        raise ValidationError(
            "sampling_support", f"{len(row)} ids tie at top_k={top_k}, filling the {asked} top logprobs asked:"
            " the support may go on past them (ask a larger k)", n)


def support_from_tops(
    tops: Sequence[Any], sampled: Sequence[int] | np.ndarray, *, rule: SupportRule, sampling: SupportSampling,
    asked: int = MAX_SUPPORT_K,
) -> SupportCSR:
    """Each sampled token's support from its top `asked` (id, logprob) pairs by `rule`;
    `ValidationError` (bad engine output) when tops are missing, a sampled token lies
    outside its support, or a support holds more than `top_k` ids (`_check_size`)."""
    ids = np.asarray(sampled, dtype=np.int64)
    if len(tops) != ids.shape[0]:
        raise ValidationError("sampling_support", f"{len(tops)} top-logprob lists for {ids.shape[0]} tokens")
    rows = []
    for n, (pairs, tok) in enumerate(zip(tops, ids.tolist(), strict=True)):
        row = _row(pairs or (), rule, sampling)
        if tok not in (i for i, _ in row):
            raise ValidationError("sampling_support", f"sampled id {tok} is outside its support {row[:8]}", n)
        _check_size(row, sampling.top_k, asked, n)
        rows.append([i for i, _ in row])
    return SupportCSR.from_lists(rows)


def line_support(turns: Sequence[Any], end: int) -> SupportCSR | None:
    """The supports of a line's tokens [0, end), one row per token: a sampled token's
    row from its turn's record, every other token's (prompt, tool output, repair) empty.
    None when no kept turn recorded a support. O(end)."""
    recorded = [t for t in turns if getattr(t, "sampling_support", None) is not None]
    if not recorded:
        return None
    lens = np.zeros(end, dtype=np.int64)
    parts = []
    for t in recorded:
        sup: SupportCSR = t.sampling_support
        lens[t.output_start : t.output_end] = np.diff(sup.offsets)
        parts.append(sup.ids)
    off = np.zeros(end + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    if off[-1] > np.iinfo(np.int32).max:
        raise InvariantError("sampling support larger than int32 offsets can index")
    return SupportCSR(np.concatenate(parts).astype(np.int32, copy=False), off.astype(np.int32))


def miles_sampling_mask(sup: SupportCSR, token_ids: np.ndarray, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """miles' per-response ragged sampling mask (`rollout_sampling_mask_ids` int32,
    `rollout_sampling_mask_offsets` int64 from 0, ``end - start + 1`` of them) over the
    tokens [start, end): a sampled token's support, every forced token (tool output,
    template glue, repair) its own id alone, as miles' `append_forced_sampling_tokens`
    gives an observation token a singleton support (miles/utils/sampling_mask.py; its
    trainer reads the ids as int32 and the offsets as int64)."""
    rows = [sup.row(i).tolist() or [int(token_ids[i])] for i in range(start, end)]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return np.fromiter((i for r in rows for i in r), dtype=np.int32, count=int(offsets[-1])), offsets
