"""Routed experts (routing replay, "R3"): per-position expert ids stored beside the tokens.

An MoE engine reports, for every *input position* it forwarded, the expert ids
each layer routed that position to: an integer array of shape
``(positions, layers, topk)``. Position ``p``'s row decides the hidden state at
``p``, which predicts token ``p + 1``; the last token of a line is never
forwarded, so a line of ``T`` tokens has ``T - 1`` rows (SGLang: rows
``[routed_experts_start_len, prompt + output - 1)``; vLLM: ``num_tokens - 1``;
miles validates ``len(rollout_routed_experts) == len(tokens) - 1``; see
docs/api.md "Routed experts").

A turn stores the rows for line positions ``[start, output_end - 1)``, where
``start`` is where the rows of the turns before it end (`coverage_end`), so a
multi-turn line is covered once, with no gap and no overlap, and each turn only
asks the engine for the positions it added. Rows are kept in the smallest
integer dtype that holds the ids (`narrow`): uint8 below 256 experts (480 bytes
per position for 60 layers x top-8).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajectory.errors import ExportError, InvariantError

__all__ = ["RoutedRows", "coverage_end", "from_json", "line_rows", "narrow", "to_json"]

JSON_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype(np.uint8), "int16": np.dtype(np.int16), "int32": np.dtype(np.int32)}

_U8_MAX = int(np.iinfo(np.uint8).max)
_I16_MAX = int(np.iinfo(np.int16).max)


def narrow(rows: np.ndarray, max_id: int | None = None) -> np.ndarray:
    """`rows` in the smallest dtype holding its ids: uint8 (< 256), int16, else int32.
    `max_id` saves a pass when the caller already knows the largest id."""
    if rows.size == 0:
        return rows.astype(np.uint8, copy=False)
    top = int(rows.max()) if max_id is None else max_id
    if top <= _U8_MAX:
        return rows.astype(np.uint8, copy=False)
    if top <= _I16_MAX:
        return rows.astype(np.int16, copy=False)
    return rows.astype(np.int32, copy=False)


@dataclass(frozen=True, slots=True, eq=False)
class RoutedRows:
    """One turn's routed experts: ``rows[i]`` is line position ``start + i``."""

    start: int
    rows: np.ndarray  # (n, layers, topk), integer, read-only

    def __post_init__(self) -> None:
        r = self.rows
        if not isinstance(r, np.ndarray) or r.ndim != 3 or r.dtype.kind not in "iu":
            raise InvariantError(f"routed experts must be a 3-D integer array, got {getattr(r, 'shape', r)!r}")
        if isinstance(self.start, bool) or not isinstance(self.start, int | np.integer) or self.start < 0:
            raise InvariantError(f"routed experts start must be an int >= 0, got {self.start!r}")
        if r.flags.writeable:
            r.flags.writeable = False

    @property
    def end(self) -> int:
        return self.start + int(self.rows.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, topk)."""
        return int(self.rows.shape[1]), int(self.rows.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)


def _rows_of(turn: object) -> RoutedRows | None:
    r = getattr(turn, "routed_experts", None)
    return r if isinstance(r, RoutedRows) else None


def _chain(turns: Sequence[object]) -> list[RoutedRows]:
    """The turns' rows that cover the line from position 0 without a gap: the chain
    restarts at a turn whose rows start at 0 and breaks at a turn without rows or
    with a gap (then nothing before it is usable)."""
    chain: list[RoutedRows] = []
    for t in turns:
        r = _rows_of(t)
        if r is None:
            chain = []
        elif r.start == 0:
            chain = [r]
        elif chain and r.start == chain[-1].end:
            chain.append(r)
        else:
            chain = []
    return chain


def coverage_end(turns: Sequence[object]) -> int:
    """Line positions ``[0, end)`` the turns' rows cover contiguously (0: none): where
    the next turn's rows start, and what it asks the engine for."""
    chain = _chain(turns)
    return chain[-1].end if chain else 0


def line_rows(turns: Sequence[object], n_tokens: int) -> np.ndarray | None:
    """Rows for positions ``[0, n_tokens - 1)`` of a line of `n_tokens` tokens (the
    trainer's ``(len(tokens) - 1, layers, topk)``), None when the turns' rows do not
    cover the line from 0. Positions after the last turn's last sampled token (its
    closing repair tokens, never forwarded by the engine) are filled with 0: they
    only shape predictions of tokens with loss mask 0."""
    chain = _chain(turns)
    want = max(0, n_tokens - 1)
    if not chain or want == 0:
        return None
    layers, topk = chain[0].shape
    if any(r.shape != (layers, topk) for r in chain):
        return None
    dtype = np.result_type(*(r.rows.dtype for r in chain))
    out = np.zeros((want, layers, topk), dtype=dtype)
    for r in chain:
        if r.start >= want:
            break
        take = min(r.end, want) - r.start
        out[r.start : r.start + take] = r.rows[:take]
    return out


def to_json(rows: np.ndarray) -> dict[str, Any]:
    """Rows as the exports' JSON object: ``{"dtype", "layers", "topk", "data"}``, with
    ``data`` the base64 of the C-order bytes."""
    return {"dtype": rows.dtype.name, "layers": int(rows.shape[1]), "topk": int(rows.shape[2]),
            "data": base64.b64encode(np.ascontiguousarray(rows).tobytes()).decode()}


def from_json(value: Any, where: str, rows: int | None = None) -> np.ndarray:
    """`to_json`'s object back as a read-only array (`rows`: the count it must hold);
    anything malformed is `ExportError`."""
    if not isinstance(value, Mapping):
        raise ExportError(f"{where}: routed_experts must be an object")
    dtype = JSON_DTYPES.get(value.get("dtype"))  # type: ignore[arg-type]
    layers, topk = value.get("layers"), value.get("topk")
    if dtype is None or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (layers, topk)):
        raise ExportError(f"{where}: routed_experts needs a dtype in {sorted(JSON_DTYPES)} and layers, topk >= 1")
    try:
        raw = base64.b64decode(value["data"], validate=True)
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{where}: routed_experts data is not base64: {exc}") from exc
    assert isinstance(layers, int) and isinstance(topk, int)
    per = layers * topk * dtype.itemsize
    if len(raw) % per or (rows is not None and len(raw) != rows * per):
        raise ExportError(f"{where}: {len(raw)} routed-experts bytes are not rows of {layers}x{topk} {dtype}")
    return np.frombuffer(raw, dtype=dtype).reshape(-1, layers, topk)
