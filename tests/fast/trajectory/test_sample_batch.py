"""Batch writers: a payload written part by part, with the arrays spooled,
is the payload the one-shot serializers write for the whole list."""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Sequence

import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from trajectory.sample_batch import (
    BATCH_WRITERS,
    NpzBatchWriter,
    SafetensorsBatchWriter,
    SampleBatchWriter,
)
from trajectory.sample_formats import (
    load_samples_json,
    load_samples_npz,
    load_samples_safetensors,
    samples_to_json,
    samples_to_npz,
    samples_to_safetensors,
)
from trajectory.samples import Sample, build_samples

from .test_samples import Oracle, assert_same_samples, trees


def write(writer: SampleBatchWriter, parts: Sequence[Sequence[Sample]]) -> bytes:
    try:
        out = [writer.head()] + [writer.add(p) for p in parts] + list(writer.chunks())
    finally:
        writer.close()
    return b"".join(out)


def split_safetensors(data: bytes) -> tuple[dict[str, object], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return orjson.loads(data[8 : 8 + n]), data[8 + n :]


def zip_entries(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {name: z.read(name) for name in z.namelist()}


@st.composite
def batches(draw: st.DrawFn) -> list[list[Sample]]:
    """Parts as a server adds them: each session's samples (some sessions have none)."""
    parts: list[list[Sample]] = []
    for i in range(draw(st.integers(0, 4))):
        o: Oracle = draw(trees()) if draw(st.booleans()) else Oracle()
        parts.append(build_samples(o.tree, picker="all", reward=0.5 * i, metadata={"session_id": f"s{i}", "é": "\n"}))
    return parts


@settings(max_examples=40, deadline=None)
@given(batches())
def test_batch_writers_equal_the_one_shot_payloads(parts: list[list[Sample]]) -> None:
    flat = [s for p in parts for s in p]
    assert write(BATCH_WRITERS["json"](), parts) == samples_to_json(flat)  # byte-equal
    # safetensors: the library orders __metadata__'s keys at random; the parsed header
    # (offsets, dtypes, shapes, metadata) and every data byte are equal
    got, want = split_safetensors(write(BATCH_WRITERS["safetensors"](), parts)), split_safetensors(samples_to_safetensors(flat))
    assert got == want
    assert list(got[0]) == list(want[0])  # tensors in the library's order
    # npz: zip timestamps differ; every entry (npy header + array bytes) is equal
    assert zip_entries(write(BATCH_WRITERS["npz"](), parts)) == zip_entries(samples_to_npz(flat))
    for fmt, load in (("json", load_samples_json), ("npz", load_samples_npz), ("safetensors", load_samples_safetensors)):
        assert_same_samples(load(write(BATCH_WRITERS[fmt](), parts)), flat)


def test_spooled_writers_go_to_disk_past_the_spool_size() -> None:
    """A batch larger than the spool keeps its arrays on disk, not in memory, and
    streams them in pieces; the payload is unchanged."""
    o = Oracle()
    for _ in range(40):
        o.commit(3, 4, 1, "stop", [1])
    samples = build_samples(o.tree, picker="all")
    parts = [samples] * 50
    flat = samples * 50
    for cls, load, dump in ((NpzBatchWriter, load_samples_npz, samples_to_npz),
                            (SafetensorsBatchWriter, load_samples_safetensors, samples_to_safetensors)):
        writer = cls(spool_bytes=1024)
        writer.head()
        for p in parts:
            writer.add(p)
        assert all(getattr(f, "_rolled", False) for f in writer._spool.files.values())
        data = b"".join(writer.chunks())
        writer.close()
        assert_same_samples(load(data), load(dump(flat)))
        assert np.array_equal(load(data)[-1].token_ids, samples[-1].token_ids)
