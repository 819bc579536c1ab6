"""Routing replay (R3): the engine's routed experts of one turn, decoded and checked.

Wire facts (docs/engines.md "Routed experts"):

* SGLang `/generate` with ``return_routed_experts: true`` (server flag
  ``--enable-return-routed-experts``) returns ``meta_info.routed_experts``: base64
  of int32, C order, rows for positions ``[routed_experts_start_len, prompt +
  output - 1)`` (sgl-project/sglang python/sglang/srt/managers/io_struct.py,
  `GenerateReqInput.routed_experts_start_len`; int32 buffers of shape (tokens,
  num_hidden_layers, num_experts_per_tok) in
  python/sglang/srt/layers/moe/routed_experts_capturer.py). The payload is flat,
  so the row width is taken, in order, from the rows the session already holds,
  from both `routed_experts_layers` and `routed_experts_topk`, or else as ids /
  positions asked when that divides, split by whichever setting is set
  (`_flat_rows`); a width that cannot be told is a 502 naming the settings.
* vLLM (server flag ``--enable-return-routed-experts``, no request field) returns
  a choice's ``routed_experts``: base64 of ``.npy`` bytes, shape ``(num_tokens - 1,
  layers, topk)``, uint8/uint16/int32, covering the whole sequence from position 0
  (vllm-project/vllm vllm/entrypoints/openai/completion/protocol.py and the
  token-in `GenerateResponseChoice`); older builds sent nested JSON lists.

Each segment of a turn (abort -> resubmit) is one `Piece`; `join` checks that the
pieces' rows line up with their tokens and with each other (the gap check) and
concatenates them. Everything here is O(payload): it runs off the event loop.

A base64 payload is decoded where the reply was parsed (`predecode`, in the reply
decoder's worker process, session_server/engines/reply_decoder.py): `binascii` holds the
GIL for the whole payload (~30 ms for 4K positions x 60 x 8 as int32, 10.5 MB),
which in this process stalls the event loop however it is threaded. Only the ids
come back, narrowed (2 MB instead of 10.5); `join` takes either form and checks
both the same way, so a payload that does not decode there stays raw and fails here
with the usual message.
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

__all__ = ["Decoded", "Piece", "RoutedShape", "decode_payload", "join", "predecode", "wire_size"]

_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class RoutedShape:
    """What the server knows of the model: any of layers, topk, experts per layer."""

    layers: int | None = None
    topk: int | None = None
    num_experts: int | None = None


@dataclass(frozen=True, eq=False)
class Decoded:
    """A base64 payload decoded by `predecode`: its ids (flat for SGLang, 3-D for
    vLLM's ``.npy``), narrowed when all lie in [0, 32767]; `wire_bytes` its size as sent."""

    ids: np.ndarray
    wire_bytes: int


@dataclass(frozen=True)
class Unrequested:
    """A routed-experts payload the turn did not ask for (a vLLM started with them on
    sends them with every reply), dropped where the reply was parsed: only its size is
    kept, the turn's `routed_experts_bytes` as for any payload."""

    wire_bytes: int


@dataclass(frozen=True)
class Piece:
    """One segment's payload (raw, or `Decoded` where the reply was parsed) and the
    positions it should cover: ``[start, prompt_len + output_len - 1)`` of the
    segment's input + output."""

    raw: bytes | Decoded | None
    prompt_len: int
    output_len: int
    start: int
    # the output the engine's rows cover, when the turn kept fewer ids than it sampled (a
    # stop string the server matched across a pause: control/stops.py); None: output_len
    sampled_len: int | None = None

    @property
    def end(self) -> int:
        return self.prompt_len + self.output_len - 1

    @property
    def rows_end(self) -> int:
        """Where the engine's rows end: past `end` when the turn kept fewer ids."""
        return self.prompt_len + (self.output_len if self.sampled_len is None else self.sampled_len) - 1


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


def predecode(raw: bytes | Decoded | None) -> bytes | Decoded | None:
    """A base64 payload as `Decoded` ids, decoded and narrowed once, where the reply is
    parsed; anything else as it came: a nested-list payload (older vLLM, small) and a
    malformed one (whose `UpstreamInvalid` `join` raises, as for any raw payload)."""
    if not isinstance(raw, bytes) or not raw.lstrip().startswith(b'"'):
        return raw
    try:
        ids = decode_payload(raw)
    except UpstreamInvalid:
        return raw
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo >= 0:  # out-of-range ids keep their dtype: `join` names them as sent
            ids = narrow(ids, hi)
    return Decoded(ids, len(raw))


def wire_size(payload: bytes | Decoded | Unrequested | None) -> int | None:
    """The payload's size as the engine sent it (the turn's `routed_experts_bytes`)."""
    if payload is None:
        return None
    return payload.wire_bytes if isinstance(payload, Decoded | Unrequested) else len(payload)


def _known(shape: RoutedShape, expect: tuple[int, int] | None) -> tuple[int, int] | None:
    """(layers, topk) known exactly: the rows the session (or this turn's earlier
    segments) already holds, else both settings; None when neither says."""
    if expect is not None:
        return expect
    if shape.layers and shape.topk:
        return shape.layers, shape.topk
    return None


def _split(per: int, shape: RoutedShape, where: str) -> tuple[int, int]:
    """A row of `per` ids as (layers, topk), by whichever of the settings is set."""
    if shape.topk and per % shape.topk == 0:
        return per // shape.topk, shape.topk
    if shape.layers and per % shape.layers == 0:
        return shape.layers, per // shape.layers
    raise UpstreamInvalid(
        f"{where}: cannot split {per} routed ids per row into (layers, topk): set routed_experts_topk "
        "and routed_experts_layers to the model's"
    )


def _flat_rows(arr: np.ndarray, p: Piece, shape: RoutedShape, expect: tuple[int, int] | None,
               where: str) -> np.ndarray:
    """SGLang's flat int32 ids as (rows, layers, topk). The row width is exact when
    known (`_known`); else it is inferred as ids / positions asked, only when that
    divides (then split by `routed_experts_topk` or `routed_experts_layers`). An
    unknown width never guesses between readings: the first segment of a session's
    rows decides it, and a wrong row count there is caught only with both settings."""
    size, want = int(arr.shape[0]), p.rows_end - p.start
    known = _known(shape, expect)
    if known is not None:
        per = known[0] * known[1]
        if size % per:
            raise UpstreamInvalid(f"{where}: {size} routed ids are not whole rows of {known[0]}x{known[1]} "
                                  "(layers x topk: the routed_experts_layers and routed_experts_topk settings, "
                                  "else the model's config.json)")
        rows = size // per
        asked = next((n for n in (want, p.rows_end) if n > 0 and size % n == 0), None)
        if rows not in (want, p.rows_end) and asked is not None:
            # whole rows of another width for exactly the positions asked: the width is
            # what is wrong, not the count (that the ids also split into rows of this
            # width is a coincidence of the turn's length), so name where it came from
            raise UpstreamInvalid(f"{where}: {size} routed ids are rows of {size // asked} for the {asked} "
                                  f"positions asked, not of {known[0]}x{known[1]} (layers x topk: the "
                                  "routed_experts_layers and routed_experts_topk settings, else the model's "
                                  "config.json)")
        return arr.reshape(rows, *known)
    if want <= 0 or size % want:
        raise UpstreamInvalid(
            f"{where}: {size} routed ids for {want} positions: the row width is unknown; set "
            "routed_experts_layers and routed_experts_topk to the model's"
        )
    layers, topk = _split(size // want, shape, where)
    return arr.reshape(want, layers, topk)


def _piece(p: Piece, shape: RoutedShape, expect: tuple[int, int] | None, where: str) -> np.ndarray:
    """One segment's rows for ``[p.start, p.end)``, checked (the gap check): exactly
    the positions asked, or (an engine that ignores the start: vLLM, older SGLang)
    every position from 0, cut at the start; each row of the settings' layers/topk."""
    if p.raw is None:
        raise UpstreamInvalid(f"{where}: the engine returned no routed experts")
    arr = p.raw.ids if isinstance(p.raw, Decoded) else decode_payload(p.raw)
    if arr.ndim == 1:
        arr = _flat_rows(arr, p, shape, expect, where)
    elif arr.ndim == 2:  # nested lists of flat rows
        per, known = int(arr.shape[1]), _known(shape, expect)
        if known is not None and known[0] * known[1] != per:
            raise UpstreamInvalid(f"{where}: rows of {per} routed ids, not {known[0]}x{known[1]}")
        arr = arr.reshape(arr.shape[0], *(known or _split(per, shape, where)))
    elif arr.ndim != 3:
        raise UpstreamInvalid(f"{where}: routed_experts of shape {arr.shape}")
    layers, topk = int(arr.shape[1]), int(arr.shape[2])
    if (shape.layers and layers != shape.layers) or (shape.topk and topk != shape.topk):
        raise UpstreamInvalid(f"{where}: rows of (layers, topk) ({layers}, {topk}), the settings say "
                              f"({shape.layers}, {shape.topk})")
    want, n, full = p.end - p.start, int(arr.shape[0]), p.rows_end
    if n == full - p.start:
        return arr[:want]
    if n == full and p.start > 0:  # every position from 0 (an engine that ignores the start)
        return arr[p.start : p.end]
    raise UpstreamInvalid(
        f"{where}: {n} routed-experts rows for positions [{p.start}, {p.end}) "
        f"({p.prompt_len} prompt + {p.output_len} output - 1 - start {p.start} = {want})"
    )


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
        rows = _piece(p, shape, expect, where)
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
