"""A batch of training samples written piece by piece (streamed), in any sample format.

A server streaming the samples of many sessions must not hold the batch: it adds
each session's samples as they are built, then drops them. JSON can go out as it
comes. npz and safetensors need every array's total length before its bytes (the
safetensors header, the npy headers), so the per-token arrays are spooled to
temporary files (`tempfile.SpooledTemporaryFile`: memory up to `spool_bytes` per
array, disk beyond) and streamed from there at the end; only the per-sample JSON
metadata (O(turns), not O(tokens)) and the offsets stay in memory.

The payload is the one `trajectory.sample_formats` defines (JSON byte-equal to the
one-shot function of the concatenated parts; safetensors equal but for the order of
the header metadata's keys, which that library randomises; npz equal entry by
entry); this module holds only the streaming machinery, so the format module stays
a readable definition of the formats and their loaders.
"""

from __future__ import annotations

import io
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.lib.format as npformat

from trajectory.errors import ExportError
from trajectory.sample_formats import (
    ARRAYS,
    FORMAT,
    FORMAT_VERSION,
    MEDIA_TYPES,
    OFFSETS_DTYPE,
    ROUTED,
    SUPPORT_IDS,
    SUPPORT_OFFSETS,
    _dumps,
    _json_object,
    _meta,
    _routed_wire,
)
from trajectory.samples import Sample

SPOOL_BYTES = 4 << 20  # per array, before a spool file goes to disk
READ_BYTES = 1 << 20  # spooled bytes read (and streamed) at a time
_JSON_HEAD = _dumps({"format": FORMAT, "version": FORMAT_VERSION, "samples": []})[:-2]  # up to "samples":[
_JSON_TAIL = b"]}"


class SampleBatchWriter(Protocol):
    """One payload for a batch whose samples arrive in parts.

    Call `head` once, `add` for each part (in order), then iterate `chunks` once;
    the bytes returned, concatenated in that order, are the payload. `close`
    frees the spool files (also when the stream stops early)."""

    media_type: str

    def head(self) -> bytes: ...
    def add(self, samples: Sequence[Sample]) -> bytes: ...
    def chunks(self) -> Iterator[bytes]: ...
    def close(self) -> None: ...


class JsonBatchWriter:
    """Byte-equal to `samples_to_json` of all the parts concatenated."""

    media_type = MEDIA_TYPES["json"]

    def __init__(self) -> None:
        self._count = 0

    def head(self) -> bytes:
        return _JSON_HEAD

    def add(self, samples: Sequence[Sample]) -> bytes:
        if not samples:
            return b""
        body = b",".join(_dumps(_json_object(s)) for s in samples)
        sep = b"," if self._count else b""
        self._count += len(samples)
        return sep + body

    def chunks(self) -> Iterator[bytes]:
        yield _JSON_TAIL

    def close(self) -> None:
        pass


class _Spool:
    """The per-token arrays of the parts added so far, on spool files, and their metadata."""

    def __init__(self, spool_bytes: int) -> None:
        self.files = {name: tempfile.SpooledTemporaryFile(max_size=spool_bytes) for name, _ in ARRAYS}
        self.metas: list[bytes] = []  # one JSON object per sample
        self.lengths: list[int] = []
        # routed experts: spooled as int16, written narrowed to uint8 when every id fits
        self.routed = tempfile.SpooledTemporaryFile(max_size=spool_bytes)
        self.routed_rows = 0
        self.routed_shape: tuple[int, ...] | None = None
        self.routed_max = 0
        # sampling support: each sample's CSR ids and offsets, int32
        self.support = {SUPPORT_IDS: tempfile.SpooledTemporaryFile(max_size=spool_bytes),
                        SUPPORT_OFFSETS: tempfile.SpooledTemporaryFile(max_size=spool_bytes)}
        self.support_sizes = {SUPPORT_IDS: 0, SUPPORT_OFFSETS: 0}

    def add(self, samples: Sequence[Sample]) -> None:
        for s in samples:
            for name, dtype in ARRAYS:
                self.files[name].write(np.ascontiguousarray(getattr(s, name), dtype=dtype).data)
            if s.routed_experts is not None:
                rows = _routed_wire(s.routed_experts)
                if self.routed_shape not in (None, rows.shape[1:]):
                    raise ExportError("samples of one batch must share routed_experts layers and topk")
                self.routed_shape = rows.shape[1:]
                self.routed.write(np.ascontiguousarray(rows, dtype=np.int16).data)
                self.routed_rows += int(rows.shape[0])
                self.routed_max = max(self.routed_max, int(rows.max()) if rows.size else 0)
            if s.sampling_support is not None:
                for name, arr in ((SUPPORT_IDS, s.sampling_support.ids), (SUPPORT_OFFSETS, s.sampling_support.offsets)):
                    self.support[name].write(np.ascontiguousarray(arr, dtype=np.int32).data)
                    self.support_sizes[name] += int(arr.shape[0])
            self.metas.append(_dumps(_meta(s)))
            self.lengths.append(len(s))

    def routed_dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.routed_max < 256 else np.int16)

    def read_routed(self) -> Iterator[bytes]:
        """The spooled rows in `routed_dtype` (converted piece by piece)."""
        f, dtype = self.routed, self.routed_dtype()
        f.seek(0)
        while data := f.read(READ_BYTES):
            yield np.frombuffer(data, dtype=np.int16).astype(dtype).tobytes()

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def offsets(self) -> np.ndarray:
        out = np.zeros(len(self.lengths) + 1, dtype=OFFSETS_DTYPE)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def metas_json(self) -> bytes:
        """The samples' metadata as one JSON list (what `_meta` of each, dumped together, is)."""
        return b"[" + b",".join(self.metas) + b"]"

    def has_support(self) -> bool:
        return self.support_sizes[SUPPORT_OFFSETS] > 0

    def read(self, name: str) -> Iterator[bytes]:
        f = self.support[name] if name in self.support else self.files[name]
        f.seek(0)
        while data := f.read(READ_BYTES):
            yield data

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.routed.close()
        for f in self.support.values():
            f.close()


class _SpooledWriter:
    media_type = MEDIA_TYPES["npz"]

    def __init__(self, spool_bytes: int = SPOOL_BYTES) -> None:
        self._spool = _Spool(spool_bytes)

    def head(self) -> bytes:
        return b""

    def add(self, samples: Sequence[Sample]) -> bytes:
        self._spool.add(samples)
        return b""

    def close(self) -> None:
        self._spool.close()


# safetensors lays tensors out by dtype (widest enum value first), then by name; the
# header lists them in that order after __metadata__ (pinned by the tests against
# `safetensors.numpy.save`)
_SAFETENSORS_ORDER = ("offsets", "logprobs", "token_ids", "weight_version_index", "loss_mask")
_SAFETENSORS_DTYPES = {"int64": "I64", "float32": "F32", "int32": "I32", "int16": "I16", "uint8": "U8"}
_SAFETENSORS_RANK = {"I64": 5, "F32": 4, "I32": 3, "I16": 2, "U8": 1}  # the library's dtype order


def _safetensors_order(routed: np.dtype | None, support: bool = False) -> list[str]:
    """`_SAFETENSORS_ORDER` with `routed_experts` and the sampling support tensors where
    the library puts them (dtype, then name)."""
    if routed is None and not support:
        return list(_SAFETENSORS_ORDER)
    dtypes = {**{n: d.name for n, d in ARRAYS}, "offsets": "int64"}
    if routed is not None:
        dtypes[ROUTED] = routed.name
    if support:
        dtypes |= {SUPPORT_IDS: "int32", SUPPORT_OFFSETS: "int32"}
    return sorted(dtypes, key=lambda n: (-_SAFETENSORS_RANK[_SAFETENSORS_DTYPES[dtypes[n]]], n))


class SafetensorsBatchWriter(_SpooledWriter):
    """The same tensors and header as `samples_to_safetensors` of all the parts (that
    library orders `__metadata__`'s keys at random; everything else is byte-equal)."""

    def chunks(self) -> Iterator[bytes]:
        spool = self._spool
        offsets = spool.offsets()
        dtypes = dict(ARRAYS) | {"offsets": OFFSETS_DTYPE}
        header: dict[str, Any] = {"__metadata__": {
            "format": FORMAT, "version": str(FORMAT_VERSION), "samples": spool.metas_json().decode(),
        }}
        routed = spool.routed_shape is not None
        if routed:
            dtypes[ROUTED] = spool.routed_dtype()
        if spool.has_support():
            dtypes |= {SUPPORT_IDS: np.dtype(np.int32), SUPPORT_OFFSETS: np.dtype(np.int32)}
        order = _safetensors_order(dtypes[ROUTED] if routed else None, spool.has_support())
        start = 0
        for name in order:
            shape = [len(offsets) if name == "offsets" else spool.total]
            if name == ROUTED:
                shape = [spool.routed_rows, *(spool.routed_shape or ())]
            elif name in spool.support:
                shape = [spool.support_sizes[name]]
            size = int(np.prod(shape)) * dtypes[name].itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtypes[name].name], "shape": shape,
                            "data_offsets": [start, start + size]}
            start += size
        raw = _dumps(header)
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        yield struct.pack("<Q", len(raw)) + raw
        for name in order:
            if name == "offsets":
                yield offsets.tobytes()
            elif name == ROUTED:
                yield from spool.read_routed()
            else:
                yield from spool.read(name)


class _Sink:
    """A write-only stream zipfile writes to (unseekable: it uses data descriptors)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def write(self, data: bytes, /) -> int:
        self._parts.append(bytes(data))
        self._size += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def drain(self, at_least: int = 0) -> Iterator[bytes]:
        if self._size and self._size >= at_least:
            out = b"".join(self._parts)
            self._parts.clear()
            self._size = 0
            yield out


class NpzBatchWriter(_SpooledWriter):
    """The same arrays as `samples_to_npz` of all the parts, as a compressed npz written
    on the fly (zip entries with data descriptors; `np.load` reads it the same)."""

    def _entries(self) -> Iterator[tuple[str, np.dtype, tuple[int, ...], Iterator[bytes]]]:
        spool = self._spool
        for name, dtype in ARRAYS:
            yield name, dtype, (spool.total,), spool.read(name)
        offsets = spool.offsets()
        yield "offsets", OFFSETS_DTYPE, (len(offsets),), iter([offsets.tobytes()])
        if spool.routed_shape is not None:
            yield ROUTED, spool.routed_dtype(), (spool.routed_rows, *spool.routed_shape), spool.read_routed()
        if spool.has_support():
            for name in (SUPPORT_IDS, SUPPORT_OFFSETS):
                yield name, np.dtype(np.int32), (spool.support_sizes[name],), spool.read(name)
        meta = _JSON_HEAD + spool.metas_json()[1:-1] + _JSON_TAIL
        yield "meta", np.dtype(np.uint8), (len(meta),), iter([meta])

    def chunks(self) -> Iterator[bytes]:
        sink = _Sink()
        # as np.savez_compressed opens its archive and entries
        with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
            for name, dtype, n, data in self._entries():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as entry:
                    head = io.BytesIO()
                    npformat.write_array_header_1_0(
                        head, {"descr": npformat.dtype_to_descr(dtype), "fortran_order": False, "shape": n}
                    )
                    entry.write(head.getvalue())
                    for part in data:
                        entry.write(part)
                        yield from sink.drain(READ_BYTES)
        yield from sink.drain()


BATCH_WRITERS: dict[str, Callable[[], SampleBatchWriter]] = {
    "json": JsonBatchWriter, "npz": NpzBatchWriter, "safetensors": SafetensorsBatchWriter,
}
