"""Routing replay (R3): the engine's routed experts of one turn, decoded and checked.

Wire facts (docs/engines.md "Routed experts"):

* SGLang `/generate` with ``return_routed_experts: true`` (server flag
  ``--enable-return-routed-experts``) returns ``meta_info.routed_experts``: base64
  of int32, C order, rows for positions ``[routed_experts_start_len, prompt +
  output - 1)`` (sgl-project/sglang python/sglang/srt/managers/io_struct.py,
  `GenerateReqInput.routed_experts_start_len`; int32 buffers of shape (tokens,
  num_hidden_layers, num_experts_per_tok) in
  python/sglang/srt/layers/moe/routed_experts_capturer.py). The payload is flat:
  the server needs the model's topk or layer count to split a row
  (`routed_experts_topk` / `routed_experts_layers` settings).
* vLLM (server flag ``--enable-return-routed-experts``, no request field) returns
  a choice's ``routed_experts``: base64 of ``.npy`` bytes, shape ``(num_tokens - 1,
  layers, topk)``, uint8/uint16/int32, covering the whole sequence from position 0
  (vllm-project/vllm vllm/entrypoints/openai/completion/protocol.py and the
  token-in `GenerateResponseChoice`); older builds sent nested JSON lists.

Each segment of a turn (abort -> resubmit) is one `Piece`; `join` checks that the
pieces' rows line up with their tokens and with each other (the gap check) and
concatenates them. Everything here is O(payload): it runs on the offload threads.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from trajectory.routed import narrow

from .errors import UpstreamInvalid

__all__ = ["Piece", "RoutedShape", "decode_payload", "join"]

_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class RoutedShape:
    """What the server knows of the model: any of layers, topk, experts per layer."""

    layers: int | None = None
    topk: int | None = None
    num_experts: int | None = None


@dataclass(frozen=True)
class Piece:
    """One segment's raw payload and the positions it should cover:
    ``[start, prompt_len + output_len - 1)`` of the segment's input + output."""

    raw: bytes | None
    prompt_len: int
    output_len: int
    start: int

    @property
    def end(self) -> int:
        return self.prompt_len + self.output_len - 1


def decode_payload(raw: bytes) -> np.ndarray:
    """The raw JSON value as an integer array, never as Python objects (but for the
    legacy nested-list form): 3-D from vLLM's ``.npy``, 1-D int32 from SGLang."""
    data = raw.strip()
    if data.startswith(b"["):  # older vLLM: nested lists
        try:
            return np.asarray(orjson.loads(data), dtype=np.int64)
        except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
            raise UpstreamInvalid(f"routed_experts list is malformed: {exc}") from exc
    if not (data.startswith(b'"') and data.endswith(b'"')):
        raise UpstreamInvalid(f"routed_experts is neither a base64 string nor a list: {data[:40]!r}")
    try:
        blob = base64.b64decode(data[1:-1], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UpstreamInvalid(f"routed_experts is not base64: {exc}") from exc
    if blob.startswith(_NPY_MAGIC):
        try:
            arr: np.ndarray = np.load(io.BytesIO(blob), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise UpstreamInvalid(f"routed_experts .npy is malformed: {exc}") from exc
        if arr.dtype.kind not in "iu":
            raise UpstreamInvalid(f"routed_experts .npy has dtype {arr.dtype}, not integers")
        return arr
    if len(blob) % 4:
        raise UpstreamInvalid(f"routed_experts has {len(blob)} bytes, not whole int32 values")
    return np.frombuffer(blob, dtype="<i4")


def _rows(arr: np.ndarray, n_rows: int, shape: RoutedShape, where: str) -> np.ndarray:
    """`arr` as (n_rows, layers, topk): a 3-D array as is, a flat one split by what
    the server knows (the session's earlier turns, else the settings)."""
    if arr.ndim == 3:
        return arr
    if arr.ndim == 2 and arr.shape[0] == n_rows:
        per = int(arr.shape[1])
    elif arr.ndim == 1:
        per = int(arr.shape[0]) // n_rows if n_rows else 0
        if n_rows == 0 or per * n_rows != arr.shape[0]:
            raise UpstreamInvalid(f"{where}: {arr.shape[0]} routed ids are not {n_rows} rows")
    else:
        raise UpstreamInvalid(f"{where}: routed_experts of shape {arr.shape}")
    if shape.topk and per % shape.topk == 0:
        layers, topk = per // shape.topk, shape.topk
    elif shape.layers and per % shape.layers == 0:
        layers, topk = shape.layers, per // shape.layers
    else:
        raise UpstreamInvalid(
            f"{where}: cannot split {per} routed ids per row into (layers, topk): set routed_experts_topk "
            "or routed_experts_layers to the model's"
        )
    return arr.reshape(n_rows, layers, topk)


def _piece(p: Piece, shape: RoutedShape, where: str) -> np.ndarray:
    """One segment's rows for ``[p.start, p.end)``, checked (the gap check)."""
    if p.raw is None:
        raise UpstreamInvalid(f"{where}: the engine returned no routed experts")
    arr = decode_payload(p.raw)
    want = p.end - p.start
    full = p.end  # an engine that ignores the start (vLLM) covers from position 0
    n = int(arr.shape[0]) if arr.ndim >= 2 else -1
    if arr.ndim == 1:  # flat (SGLang): the row count follows from the row width
        size, per = int(arr.shape[0]), _per_row(shape)
        if per:
            n = size // per if size % per == 0 else -1
        else:
            n = next((k for k in (want, full) if k > 0 and size % k == 0), -1)
    if n == full and full != want:
        rows = _rows(arr, full, shape, where)[p.start :]
    elif n == want:
        rows = _rows(arr, want, shape, where)
    else:
        raise UpstreamInvalid(
            f"{where}: {n} routed-experts rows for positions [{p.start}, {p.end}) "
            f"({p.prompt_len} prompt + {p.output_len} output - 1 - start {p.start} = {want})"
        )
    return rows


def _per_row(shape: RoutedShape) -> int | None:
    if shape.layers and shape.topk:
        return shape.layers * shape.topk
    return None


def join(pieces: Sequence[Piece], *, start: int, end: int, shape: RoutedShape,
         expect: tuple[int, int] | None = None) -> np.ndarray:
    """The turn's rows for positions ``[start, end)``: the pieces' rows concatenated,
    each lining up with its segment's tokens and continuing the previous one, all of
    one (layers, topk) (`expect`: the session's, when it has earlier rows), ids in
    ``[0, num_experts)``; narrowed to uint8/int16. Anything else is `UpstreamInvalid`."""
    parts: list[np.ndarray] = []
    pos = start
    for i, p in enumerate(pieces):
        where = f"routed experts of segment {i}"
        if p.start != pos:
            raise UpstreamInvalid(f"{where} start at {p.start}, the rows before end at {pos}")
        rows = _piece(p, shape, where)
        if expect is None:
            expect = (int(rows.shape[1]), int(rows.shape[2]))
        if rows.shape[1:] != expect:
            raise UpstreamInvalid(f"{where}: (layers, topk) {tuple(rows.shape[1:])}, expected {expect}")
        parts.append(rows)
        pos = p.end
    if pos != end:
        raise UpstreamInvalid(f"routed experts cover positions [{start}, {pos}), the turn needs [{start}, {end})")
    if not parts:
        raise UpstreamInvalid("the engine returned no routed experts")
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if out.size:
        lo, hi = int(out.min()), int(out.max())
        if lo < 0 or (shape.num_experts is not None and hi >= shape.num_experts):
            bound = shape.num_experts if shape.num_experts is not None else "inf"
            raise UpstreamInvalid(f"routed expert ids span [{lo}, {hi}], outside [0, {bound})")
        return narrow(out, hi)
    return narrow(out)
