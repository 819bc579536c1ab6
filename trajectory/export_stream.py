"""The tree's JSON export written in pieces of bounded work.

`trajectory.export.to_dict` followed by one ``orjson.dumps`` is a single long
GIL-holding call on a large tree; a server that serves exports from its event loop
needs the same bytes produced a piece at a time so it can yield between pieces.
This module is that writer, kept apart from `trajectory.export` (which owns the
format: its dict shape, npz form and import) so the format module stays readable.

* `iter_json` / `to_json_bytes`: the UTF-8 JSON of `to_dict` (byte for byte what
  ``orjson.dumps(to_dict(...), option=OPT_SERIALIZE_NUMPY)`` gives).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from trajectory.export import (
    _dumps,
    _header,
    _own_arrays,
    _own_messages,
    _own_routed,
    _own_turns,
    turn_to_dict,
)
from trajectory.tree import Branch, TrajectoryTree

# Elements per piece of `iter_json`: 8192 floats serialise in well under 1 ms here.
JSON_CHUNK_ELEMENTS = 8192
# Turns or messages per piece (each is a small dict; message contents can be long).
JSON_CHUNK_RECORDS = 64
# Bytes of routed-experts rows per base64 piece of `iter_json` (a multiple of 3, so
# the pieces' base64 concatenates to the whole array's).
ROUTED_CHUNK_BYTES = 3 * 256 * 1024


def _routed_head(rows: np.ndarray) -> dict[str, Any]:
    return {"dtype": rows.dtype.name, "layers": int(rows.shape[1]), "topk": int(rows.shape[2])}


def _iter_routed(rows: np.ndarray) -> Iterator[bytes]:
    """``"routed_experts": {...}`` of a branch, its base64 written in pieces."""
    yield b',"routed_experts":' + _dumps(_routed_head(rows))[:-1] + b',"data":"'
    flat = rows.reshape(-1).view(np.uint8)
    for start in range(0, flat.shape[0], ROUTED_CHUNK_BYTES):
        yield base64.b64encode(flat[start : start + ROUTED_CHUNK_BYTES].tobytes())
    yield b'"}'


def _iter_list(items: Iterable[Any], per: int, convert: Callable[[Any], Any]) -> Iterator[bytes]:
    """A JSON array written `per` items at a time (each piece one short orjson call)."""
    seq = list(items)
    if not seq:
        yield b"[]"
        return
    for start in range(0, len(seq), per):
        body = _dumps([convert(x) for x in seq[start : start + per]])[1:-1]  # drop [ ]
        yield (b"[" if start == 0 else b",") + body
    yield b"]"


def _iter_array(values: np.ndarray, per: int) -> Iterator[bytes]:
    """A JSON array of a 1-D array, `per` elements a piece; `tolist` widens float32
    to Python floats exactly as `to_dict` does, so the digits are the same."""
    if not len(values):
        yield b"[]"
        return
    for start in range(0, len(values), per):
        body = _dumps(values[start : start + per].tolist())[1:-1]
        yield (b"[" if start == 0 else b",") + body
    yield b"]"


def _iter_branch(b: Branch, chunk: int) -> Iterator[bytes]:
    """One branch's JSON in `to_dict`'s key order: meta, turns, messages, arrays."""
    head = {"id": b.id, "parent_id": b.parent_id, "fork_checkpoint": b.fork_checkpoint,
            "fork_index": b.fork_index, "reason": b.reason}
    yield _dumps(head)[:-1] + b',"turns":'
    yield from _iter_list(_own_turns(b), JSON_CHUNK_RECORDS, turn_to_dict)
    yield b',"messages":'
    yield from _iter_list(_own_messages(b), JSON_CHUNK_RECORDS, dict)
    ids, mask, lps = _own_arrays(b)
    for key, values in (("token_ids", ids), ("loss_mask", mask), ("logprobs", lps)):
        yield b',"' + key.encode() + b'":'
        yield from _iter_array(values, chunk)
    routed = _own_routed(b)
    if routed is not None:
        yield from _iter_routed(routed)
    yield b"}"


def iter_json(
    tree: TrajectoryTree, *, metadata: Mapping[str, Any] | None = None, chunk: int = JSON_CHUNK_ELEMENTS
) -> Iterator[bytes]:
    """`to_dict`'s JSON in pieces, each a bounded amount of work.

    One ``orjson.dumps(to_dict(tree))`` at 100K tokens is one long GIL-holding
    call; here token arrays go `chunk` elements at a time and turns/messages
    `JSON_CHUNK_RECORDS` at a time, so a caller can yield to its event loop
    between pieces. ``b"".join(iter_json(t))`` equals that one call's bytes.
    The tree must not change while the iterator is consumed."""
    yield _dumps(_header(tree, metadata))[:-1] + b',"branches":['
    for i, b in enumerate(tree.branches()):
        if i:
            yield b","
        yield from _iter_branch(b, chunk)
    yield b"]}"


def to_json_bytes(tree: TrajectoryTree, *, metadata: Mapping[str, Any] | None = None) -> bytes:
    """The whole tree as JSON bytes (``iter_json`` joined)."""
    return b"".join(iter_json(tree, metadata=metadata))
