"""A batch of training samples as JSON, npz or safetensors, each round-tripping exactly.

One payload holds a whole batch (any number of samples, from any sessions).

* **JSON** (`samples_to_json` / `load_samples_json`): ``{"format":
  "tito-samples", "version": 1, "samples": [...]}``, one object per sample with
  every `Sample` field; arrays are plain lists (float32 logprobs widened to
  Python floats, which parse back to the same float32).
* **npz** (`samples_to_npz` / `load_samples_npz`) and **safetensors**
  (`samples_to_safetensors` / `load_samples_safetensors`): the per-token arrays
  of all samples concatenated, ``token_ids`` int32, ``loss_mask`` uint8,
  ``logprobs`` float32, ``weight_version_index`` int32, plus ``offsets`` int64
  [B + 1] (sample ``i`` is ``[offsets[i], offsets[i+1])``). Everything else
  (turn boundaries, status, reason, reward, turn rewards, turn lineage, metadata,
  diagnostics, path, version table) is one JSON list, one object per sample: the uint8 array
  ``meta`` in npz, the ``samples`` key of the safetensors header metadata
  (``__metadata__``, str -> str, so a JSON string) next to ``format`` and
  ``version``.

**Per-turn rewards** (`turn_rewards`, `trajectory.turn_rewards`) are O(turns) like the
turn boundaries they align with, so they travel beside them: one JSON list per sample,
a number or null per turn, in every format. **Lineage** (`turn_lineage`,
`trajectory.lineage`) likewise: one object (``agent``, ``kind``, ``thread``,
``parent``, ``source``) or null per turn. A payload written before either field
loads with null for every turn.

**Routed experts** (routing replay, `Sample.routed_experts`: one row per
position but the last, ``(len - 1, layers, topk)``) travel only for samples
that have them, so a batch without them is unchanged: in JSON the sample's
object gets ``"routed_experts": {"dtype", "layers", "topk", "data"}`` (``data``
the base64 of the C-order bytes); in npz and safetensors the rows of those
samples are concatenated in sample order into one tensor ``routed_experts``
``(rows, layers, topk)`` (uint8 when every id is below 256, else int16), and
their metadata objects get ``"routed_experts": true``. All samples of one batch
share ``layers`` and ``topk``.

**Sampling support** (`Sample.sampling_support`, CSR over every token, see
`trajectory.support`) likewise: in JSON ``"sampling_support": {"ids", "offsets"}``
(int lists); in npz and safetensors the samples' ``ids`` concatenated into
``sampling_support_ids`` int32 and their offsets (``len + 1`` each, from 0) into
``sampling_support_offsets`` int32, their metadata objects getting
``"sampling_support": true``.

A batch can also be written part by part (`trajectory.sample_batch.BATCH_WRITERS`:
`JsonBatchWriter`, `NpzBatchWriter`, `SafetensorsBatchWriter`), so a server streams
many sessions' samples without holding them: the same payload as the one-shot
function of the concatenated parts (JSON byte-equal; safetensors equal but for the
order of the header metadata's keys, which the library randomises; npz equal entry
by entry).

Loading checks everything (dtypes, lengths, offsets, turn order, statuses,
version indices, mask/logprob agreement) and raises `ExportError` on anything
malformed; loaded samples' arrays are views into the batch arrays (no copy).
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import safetensors
import safetensors.numpy

from trajectory.errors import ExportError
from trajectory.routed import from_json as routed_from_json
from trajectory.routed import to_json as routed_to_json
from trajectory.sample_checks import ARRAYS, check_arrays, check_int, check_meta
from trajectory.samples import Sample
from trajectory.support import SupportCSR

FORMAT = "tito-samples"
FORMAT_VERSION = 1
OFFSETS_DTYPE = np.dtype(np.int64)
_META_KEYS = ("turn_boundaries", "status", "reason", "reward", "turn_rewards", "turn_lineage", "metadata",
              "diagnostics", "path", "version_table")
_PER_TURN = ("turn_rewards", "turn_lineage")  # absent in payloads written before them: null per turn
ROUTED = "routed_experts"
SUPPORT, SUPPORT_IDS, SUPPORT_OFFSETS = "sampling_support", "sampling_support_ids", "sampling_support_offsets"
_I16_MAX = int(np.iinfo(np.int16).max)


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        raise ExportError(f"sample metadata or diagnostics are not JSON-serialisable: {exc}") from exc


def _meta(s: Sample) -> dict[str, Any]:
    return {
        "turn_boundaries": [list(t) for t in s.turn_boundaries],
        "status": s.status,
        "reason": s.reason,
        "reward": s.reward,
        "turn_rewards": s.turn_rewards,
        "turn_lineage": s.turn_lineage,
        "metadata": s.metadata,
        "diagnostics": s.diagnostics,
        "path": s.path,
        "version_table": s.version_table,
    } | ({ROUTED: True} if s.routed_experts is not None else {}) | (
        {SUPPORT: True} if s.sampling_support is not None else {})


def _routed_wire(rows: np.ndarray, where: str = "sample") -> np.ndarray:
    """A sample's rows as the batch formats store them (ids below 2**15)."""
    if rows.ndim != 3 or rows.dtype.kind not in "iu":
        raise ExportError(f"{where} routed_experts must be a 3-D integer array, got {rows.dtype} {rows.shape}")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) > _I16_MAX):
        raise ExportError(f"{where} routed_experts ids must be in [0, {_I16_MAX}]")
    return rows


def _routed_batch(samples: Sequence[Sample]) -> np.ndarray | None:
    """The rows of the samples that have them, concatenated (None: none has)."""
    parts = [_routed_wire(s.routed_experts) for s in samples if s.routed_experts is not None]
    if not parts:
        return None
    if len({p.shape[1:] for p in parts}) > 1:
        raise ExportError("samples of one batch must share routed_experts layers and topk")
    out = np.concatenate(parts)
    top = int(out.max()) if out.size else 0
    return np.ascontiguousarray(out, dtype=np.uint8 if top < 256 else np.int16)


# -- writing -------------------------------------------------------------------


def _json_object(s: Sample) -> dict[str, Any]:
    d: dict[str, Any] = {name: getattr(s, name).tolist() for name, _ in ARRAYS}
    d.update(_meta(s))
    if s.routed_experts is not None:
        rows = _routed_batch([s])
        assert rows is not None
        d[ROUTED] = routed_to_json(rows)
    if s.sampling_support is not None:
        d[SUPPORT] = {"ids": s.sampling_support.ids.tolist(), "offsets": s.sampling_support.offsets.tolist()}
    return d


def samples_to_json(samples: Sequence[Sample]) -> bytes:
    """The batch as UTF-8 JSON (lists)."""
    return _dumps({"format": FORMAT, "version": FORMAT_VERSION, "samples": [_json_object(s) for s in samples]})


def _concatenated(samples: Sequence[Sample]) -> dict[str, np.ndarray]:
    arrays = {
        name: np.concatenate([getattr(s, name) for s in samples]).astype(dtype, copy=False)
        if samples else np.empty(0, dtype=dtype)
        for name, dtype in ARRAYS
    }
    offsets = np.zeros(len(samples) + 1, dtype=OFFSETS_DTYPE)
    np.cumsum([len(s) for s in samples], out=offsets[1:])
    arrays["offsets"] = offsets
    routed = _routed_batch(samples)
    if routed is not None:
        arrays[ROUTED] = routed
    sup = [s.sampling_support for s in samples if s.sampling_support is not None]
    if sup:
        arrays[SUPPORT_IDS] = np.concatenate([c.ids for c in sup]).astype(np.int32, copy=False)
        arrays[SUPPORT_OFFSETS] = np.concatenate([c.offsets for c in sup]).astype(np.int32, copy=False)
    return arrays


def samples_to_npz(samples: Sequence[Sample]) -> bytes:
    """The batch as compressed npz: concatenated arrays, offsets and a JSON `meta`."""
    arrays = _concatenated(samples)
    head = {"format": FORMAT, "version": FORMAT_VERSION, "samples": [_meta(s) for s in samples]}
    arrays["meta"] = np.frombuffer(_dumps(head), dtype=np.uint8)
    sink = io.BytesIO()
    np.savez_compressed(sink, **arrays)  # type: ignore[arg-type]
    return sink.getvalue()


def samples_to_safetensors(samples: Sequence[Sample]) -> bytes:
    """The batch as safetensors: concatenated tensors, offsets, JSON in the header metadata."""
    metadata = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "samples": _dumps([_meta(s) for s in samples]).decode(),
    }
    return bytes(safetensors.numpy.save(_concatenated(samples), metadata=metadata))


# -- the formats by name (the samples route's `format`) --------------------------

MEDIA_TYPES = {"json": "application/json", "npz": "application/octet-stream",
               "safetensors": "application/octet-stream"}
FORMATS = tuple(MEDIA_TYPES)
SERIALIZERS: dict[str, Callable[[Sequence[Sample]], bytes]] = {
    "json": samples_to_json, "npz": samples_to_npz, "safetensors": samples_to_safetensors,
}


# -- reading -------------------------------------------------------------------


def _sample(arrays: Mapping[str, np.ndarray], meta: Any, where: str) -> Sample:
    if isinstance(meta, dict) and (ROUTED in meta or SUPPORT in meta):
        meta = {k: v for k, v in meta.items() if k not in (ROUTED, SUPPORT)}
    if isinstance(meta, dict) and any(k not in meta for k in _PER_TURN):  # written before them: none
        tb = meta.get("turn_boundaries")
        meta = {**{k: [None] * (len(tb) if isinstance(tb, list) else 0) for k in _PER_TURN}, **meta}
    if not isinstance(meta, dict) or set(meta) != set(_META_KEYS):
        raise ExportError(f"{where} has fields {sorted(meta) if isinstance(meta, dict) else meta!r}")
    try:
        turns = [(check_int(p, where), check_int(o, where), check_int(e, where)) for p, o, e in meta["turn_boundaries"]]
        path = [check_int(b, f"{where} path") for b in meta["path"]]
        table = list(meta["version_table"])
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{where}: malformed turn_boundaries, path or version_table: {exc}") from exc
    for k in _PER_TURN:
        if not isinstance(meta[k], list) or len(meta[k]) != len(turns):
            raise ExportError(f"{where} {k} must be a list of {len(turns)} (one per turn)")
    s = Sample(
        token_ids=arrays["token_ids"],
        loss_mask=arrays["loss_mask"],
        logprobs=arrays["logprobs"],
        weight_version_index=arrays["weight_version_index"],
        version_table=table,
        turn_boundaries=turns,
        status=meta["status"],
        reason=meta["reason"],
        reward=meta["reward"],
        turn_rewards=meta["turn_rewards"],
        turn_lineage=meta["turn_lineage"],
        metadata=meta["metadata"],
        diagnostics=meta["diagnostics"],
        path=path,
        routed_experts=arrays.get(ROUTED),
        sampling_support=_support_csr(arrays.get(SUPPORT_IDS), arrays.get(SUPPORT_OFFSETS), where),
    )
    check_arrays(s, where)
    check_meta(s, where)
    return s


def _support_csr(ids: Any, offsets: Any, where: str) -> SupportCSR | None:
    if ids is None and offsets is None:
        return None
    try:
        return SupportCSR(np.asarray(ids), np.asarray(offsets))
    except Exception as exc:  # InvariantError, or a non-array: the payload is malformed
        raise ExportError(f"{where} sampling_support: {exc}") from exc


def _check_header(head: Mapping[str, Any]) -> None:
    if head.get("format") != FORMAT or head.get("version") != FORMAT_VERSION:
        raise ExportError(
            f"not a {FORMAT} v{FORMAT_VERSION} payload: {head.get('format')!r} v{head.get('version')!r}"
        )


def _split(arrays: Mapping[str, np.ndarray], metas: Any) -> list[Sample]:
    """Samples from concatenated arrays + offsets + one meta object per sample."""
    if not isinstance(metas, list):
        raise ExportError("samples metadata is not a list")
    try:
        offsets = arrays["offsets"]
        flat = {name: arrays[name] for name, _ in ARRAYS}
    except KeyError as exc:
        raise ExportError(f"payload lacks the array {exc}") from None
    if offsets.dtype != OFFSETS_DTYPE or offsets.shape != (len(metas) + 1,):
        raise ExportError(f"offsets must be int64 [{len(metas) + 1}], got {offsets.dtype} {offsets.shape}")
    total = int(flat["token_ids"].shape[0]) if flat["token_ids"].ndim == 1 else -1
    if offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
        raise ExportError("offsets do not partition the concatenated arrays")
    for name, dtype in ARRAYS:
        if flat[name].dtype != dtype or flat[name].shape != (total,):
            raise ExportError(f"{name} must be {dtype} [{total}]")
    bounds = offsets.tolist()
    routed, pos = arrays.get(ROUTED), 0
    sup_ids, sup_off, spos, sid = arrays.get(SUPPORT_IDS), arrays.get(SUPPORT_OFFSETS), 0, 0
    out = []
    for i, (a, b, m) in enumerate(zip(bounds[:-1], bounds[1:], metas, strict=True)):
        part = {k: v[a:b] for k, v in flat.items()}
        if isinstance(m, dict) and m.get(ROUTED) is True:
            n = max(0, b - a - 1)
            if routed is None or routed.ndim != 3 or pos + n > routed.shape[0]:
                raise ExportError(f"sample {i}: routed_experts rows missing from the batch")
            part[ROUTED] = routed[pos : pos + n]
            pos += n
        if isinstance(m, dict) and m.get(SUPPORT) is True:
            if sup_ids is None or sup_off is None or sup_off.ndim != 1 or spos + b - a + 1 > sup_off.shape[0]:
                raise ExportError(f"sample {i}: sampling_support missing from the batch")
            off = sup_off[spos : spos + b - a + 1]
            part[SUPPORT_OFFSETS], part[SUPPORT_IDS] = off, sup_ids[sid : sid + int(off[-1])]
            spos, sid = spos + b - a + 1, sid + int(off[-1])
        out.append(_sample(part, m, f"sample {i}"))
    if routed is not None and pos != routed.shape[0]:
        raise ExportError(f"{routed.shape[0] - pos} routed_experts rows belong to no sample")
    if sup_off is not None and (spos != sup_off.shape[0] or sup_ids is None or sid != sup_ids.shape[0]):
        raise ExportError("sampling_support entries belong to no sample")
    return out


def _int32s(values: list[Any], where: str) -> np.ndarray:
    if not all(type(v) is int for v in values):
        raise ExportError(f"{where} must be ints")
    arr = np.array(values, dtype=np.int64)
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ExportError(f"{where} do not fit int32")
    return arr.astype(np.int32)


def load_samples_json(data: bytes | str | Mapping[str, Any]) -> list[Sample]:
    """Samples from `samples_to_json` output (bytes, str, or the parsed object)."""
    try:
        head = orjson.loads(data) if isinstance(data, bytes | str) else data
    except orjson.JSONDecodeError as exc:
        raise ExportError(f"not JSON: {exc}") from exc
    if not isinstance(head, Mapping):
        raise ExportError("samples JSON is not an object")
    _check_header(head)
    items = head.get("samples")
    if not isinstance(items, list):
        raise ExportError("samples JSON has no list of samples")
    out = []
    for i, d in enumerate(items):
        where = f"sample {i}"
        if not isinstance(d, dict):
            raise ExportError(f"{where} is not an object")
        arrays = {}
        for name, dtype in ARRAYS:
            values = d.get(name)
            if not isinstance(values, list):
                raise ExportError(f"{where} {name} must be a list")
            allowed = (int, float) if dtype.kind == "f" else (int,)
            if not set(map(type, values)) <= set(allowed):
                raise ExportError(f"{where} {name} holds values that are not {dtype}")
            try:
                arr = np.array(values, dtype=dtype)
            except OverflowError as exc:
                raise ExportError(f"{where} {name}: {exc}") from exc
            if dtype.kind in "iu" and values and not np.array_equal(arr, values):
                raise ExportError(f"{where} {name} does not fit {dtype}")
            arrays[name] = arr
        if d.get(ROUTED) is not None:
            arrays[ROUTED] = routed_from_json(d[ROUTED], where, max(0, len(arrays["token_ids"]) - 1))
        sup = d.get(SUPPORT)
        if sup is not None:
            if not isinstance(sup, dict) or not all(isinstance(sup.get(k), list) for k in ("ids", "offsets")):
                raise ExportError(f"{where} sampling_support must be {{'ids': [...], 'offsets': [...]}}")
            arrays[SUPPORT_IDS] = _int32s(sup["ids"], f"{where} sampling_support ids")
            arrays[SUPPORT_OFFSETS] = _int32s(sup["offsets"], f"{where} sampling_support offsets")
        skip = (ROUTED, SUPPORT)
        out.append(_sample(arrays, {k: v for k, v in d.items() if k not in arrays and k not in skip}, where))
    return out


def load_samples_npz(data: bytes) -> list[Sample]:
    """Samples from `samples_to_npz` output."""
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
        files = {name: npz[name] for name in npz.files}
        head = orjson.loads(files.pop("meta").tobytes())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, orjson.JSONDecodeError) as exc:
        raise ExportError(f"not a samples npz: {type(exc).__name__}: {exc}") from exc
    if not isinstance(head, dict):
        raise ExportError("npz meta is not a JSON object")
    _check_header(head)
    return _split(files, head.get("samples"))


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The header's ``__metadata__`` (safetensors: u64 little-endian length, JSON header)."""
    if len(data) < 8:
        raise ExportError("not a safetensors payload: shorter than its header length")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = orjson.loads(data[8 : 8 + n])
    except orjson.JSONDecodeError as exc:
        raise ExportError(f"safetensors header is not JSON: {exc}") from exc
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ExportError("safetensors payload has no __metadata__")
    return meta


def load_samples_safetensors(data: bytes) -> list[Sample]:
    """Samples from `samples_to_safetensors` output."""
    meta = _safetensors_metadata(data)
    try:
        version = int(meta.get("version", ""))
    except ValueError:
        version = -1
    _check_header({"format": meta.get("format"), "version": version})
    try:
        arrays = safetensors.numpy.load(bytes(data))
        metas = orjson.loads(meta["samples"])
    except (safetensors.SafetensorError, KeyError, orjson.JSONDecodeError) as exc:
        raise ExportError(f"not a samples safetensors: {type(exc).__name__}: {exc}") from exc
    return _split(arrays, metas)
