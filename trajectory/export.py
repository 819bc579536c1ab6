"""Export and import of a session's `TrajectoryTree` for trainers: JSON and npz.

Both forms carry every branch (id, parent, fork point, reason) and what that
branch added itself, as the tree stores it (version 2): its tokens from its
fork point on (``token_ids``, ``loss_mask``, ``logprobs`` with 0.0 where the
mask is 0; ``token_ids[0]`` sits at position ``fork_index`` of the branch's
line), its own turns (every field, weight spans and commit ``seq`` included;
``index`` counts from the fork checkpoint) and its own messages, plus the
session metadata. A branch's whole line is its ancestors' parts up to the fork
points followed by its own: import rebuilds the shared tree, and
`branch_line` gives one line's arrays. So an export is O(unique tokens), like
the tree. Version 1 exports (every branch a full copy of its line) still
import; their shared prefixes are checked against the parent's and dropped.
Round trips are exact: float32 logprobs survive bit for bit (a float32 widened
to a Python float prints and parses back to the same value).

* `to_dict` / `from_dict`: a JSON-ready dict (plain lists, str keys).
* `trajectory.export_stream.iter_json` / `to_json_bytes`: the UTF-8 JSON of
  `to_dict` (byte for byte what ``orjson.dumps(to_dict(...),
  option=OPT_SERIALIZE_NUMPY)`` gives), produced in pieces of bounded work so an
  event loop can run between them.
* `to_npz_bytes` / `from_npz_bytes`: ``numpy.savez_compressed`` with three typed
  arrays per branch (``b{id}_token_ids`` int32, ``b{id}_loss_mask`` uint8,
  ``b{id}_logprobs`` float32) and one uint8 array ``meta`` holding the UTF-8
  JSON of everything else. Loaded with ``allow_pickle=False``.

A turn's sampling support (`trajectory.support`), where captured: ``"sampling_support":
{"ids", "offsets"}`` in its dict (its CSR as int lists). Routed experts (routing replay, `trajectory.routed`), only where turns have them,
so exports without them are unchanged: each such turn's dict has
``"routed_experts": {"start", "rows"}`` and its branch the rows of its own turns
concatenated in turn order, shape ``(sum rows, layers, topk)``: in JSON a
branch key ``"routed_experts": {"dtype", "layers", "topk", "data"}`` with
``data`` the base64 of the C-order array bytes (written in pieces, like the
token arrays); in npz an array ``b{id}_routed_experts``.

Import re-checks every invariant; anything malformed raises `ExportError`.
"""

from __future__ import annotations

import dataclasses
import io
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from trajectory.buffer import TokenBuffer
from trajectory.errors import ExportError, TrajectoryError
from trajectory.history import fork_reason_now
from trajectory.lineage import Lineage, lineage_from_dict
from trajectory.linear import LinearTrajectory
from trajectory.routed import RoutedRows
from trajectory.routed import from_json as routed_from_json
from trajectory.routed import to_json as routed_to_json
from trajectory.support import SupportCSR
from trajectory.tree import Branch, TrajectoryTree
from trajectory.turn_record import TurnRecord, WeightSpan

FORMAT = "tito-trajectory"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_ARRAYS = (("token_ids", np.int32), ("loss_mask", np.uint8), ("logprobs", np.float32))


def turn_to_dict(t: TurnRecord) -> dict[str, Any]:
    """A turn as export writes it (also the viewer's `/line` turns: one shape)."""
    out: dict[str, Any] = {
        "index": t.index,
        "prompt_start": t.prompt_start,
        "output_start": t.output_start,
        "output_end": t.output_end,
        "end": t.end,
        "finish_reason": t.finish_reason,
        "weight_version": t.weight_version,
        "weight_spans": [[s, e, v] for s, e, v in t.weight_spans],
        "engine": t.engine,
        "cached_tokens": t.cached_tokens,
        "repair_tokens": t.repair_tokens,
        "request_messages": [dict(m) for m in t.request_messages],
        "assistant_message": None if t.assistant_message is None else dict(t.assistant_message),
        "extra": dict(t.extra),
        "seq": t.seq,
        "lineage": None if t.lineage is None else t.lineage.to_dict(),
    }
    if t.routed_experts is not None:
        out["routed_experts"] = {"start": t.routed_experts.start, "rows": int(t.routed_experts.rows.shape[0])}
    if t.sampling_support is not None:  # one row per sampled id (`trajectory.support`), only where asked
        out["sampling_support"] = {"ids": t.sampling_support.ids.tolist(), "offsets": t.sampling_support.offsets.tolist()}
    return out


def _lineage(d: Any, where: str) -> Lineage | None:
    try:
        return lineage_from_dict(d)
    except ValueError as exc:
        raise ExportError(f"{where}: {exc}") from exc


def _support(d: Any, where: str) -> SupportCSR | None:
    if d is None:
        return None
    try:
        return SupportCSR(_typed(d["ids"], np.int32, f"{where} support ids"),
                          _typed(d["offsets"], np.int32, f"{where} support offsets"))
    except (TypeError, KeyError, TrajectoryError) as exc:
        raise ExportError(f"{where}: sampling_support is not CSR ids and offsets ({exc})") from exc


def _own_turns(b: Branch) -> tuple[TurnRecord, ...]:
    return b.trajectory.turns[b.fork_checkpoint :]


def _own_messages(b: Branch) -> list[Any]:
    traj = b.trajectory
    return traj.messages()[traj.checkpoint_message_counts[b.fork_checkpoint] :]


def _own_arrays(b: Branch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids, mask and logprobs the branch added (its buffer: the tree shares the rest)."""
    buf = b.trajectory.buffer
    return buf.ids, buf.mask, buf.logprobs


def _own_routed(b: Branch) -> np.ndarray | None:
    """The rows of the branch's own turns, concatenated in turn order (None: none)."""
    parts = [t.routed_experts.rows for t in _own_turns(b) if t.routed_experts is not None]
    if not parts:
        return None
    return np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])


def _branch_meta(b: Branch) -> dict[str, Any]:
    return {
        "id": b.id,
        "parent_id": b.parent_id,
        "fork_checkpoint": b.fork_checkpoint,
        "fork_index": b.fork_index,
        "reason": b.reason,
        "turns": [turn_to_dict(t) for t in _own_turns(b)],
        "messages": [dict(m) for m in _own_messages(b)],
    }


def _header(tree: TrajectoryTree, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "active_branch": tree.active_id,
        "metadata": dict(tree.metadata if metadata is None else metadata),
    }


def to_dict(tree: TrajectoryTree, *, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole tree as a JSON-ready dict (`metadata` defaults to `tree.metadata`)."""
    out = _header(tree, metadata)
    branches = []
    for b in tree.branches():
        d = _branch_meta(b)
        ids, mask, lps = _own_arrays(b)
        d["token_ids"] = ids.tolist()
        d["loss_mask"] = mask.tolist()
        d["logprobs"] = lps.tolist()
        routed = _own_routed(b)
        if routed is not None:
            d["routed_experts"] = routed_to_json(routed)
        branches.append(d)
    out["branches"] = branches
    return out


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise ExportError(f"turns, messages or metadata are not JSON-serialisable: {exc}") from exc


def to_npz_bytes(tree: TrajectoryTree, *, metadata: Mapping[str, Any] | None = None) -> bytes:
    """The whole tree as compressed npz bytes (typed arrays + a JSON sidecar)."""
    meta = _header(tree, metadata)
    meta["branches"] = [_branch_meta(b) for b in tree.branches()]
    try:
        sidecar = orjson.dumps(meta, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise ExportError(f"turns, messages or metadata are not JSON-serialisable: {exc}") from exc
    arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(sidecar, dtype=np.uint8)}
    for b in tree.branches():
        ids, mask, lps = _own_arrays(b)
        arrays[f"b{b.id}_token_ids"] = ids
        arrays[f"b{b.id}_loss_mask"] = mask
        arrays[f"b{b.id}_logprobs"] = lps
        routed = _own_routed(b)
        if routed is not None:
            arrays[f"b{b.id}_routed_experts"] = routed
    sink = io.BytesIO()
    np.savez_compressed(sink, **arrays)  # type: ignore[arg-type]
    return sink.getvalue()


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExportError(f"{name} must be an int, got {value!r}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    return None if value is None else _int(value, name)


def _turn_from_dict(d: Mapping[str, Any], where: str, seq: int | None) -> TurnRecord:
    """One turn; `seq` is given for version 1 exports (which had none), else read."""
    spans: list[WeightSpan] = []
    for s in d["weight_spans"]:
        if len(s) != 3:
            raise ExportError(f"{where}: weight span {s!r} is not [start, end, version]")
        spans.append((_int(s[0], f"{where} span start"), _int(s[1], f"{where} span end"), s[2]))
    assistant = d["assistant_message"]
    turn = TurnRecord(
        index=_int(d["index"], f"{where} index"),
        prompt_start=_int(d["prompt_start"], f"{where} prompt_start"),
        output_start=_int(d["output_start"], f"{where} output_start"),
        output_end=_int(d["output_end"], f"{where} output_end"),
        end=_int(d["end"], f"{where} end"),
        finish_reason=str(d["finish_reason"]),
        weight_spans=tuple(spans),
        engine=d["engine"],
        cached_tokens=_int(d["cached_tokens"], f"{where} cached_tokens"),
        repair_tokens=_int(d["repair_tokens"], f"{where} repair_tokens"),
        request_messages=tuple(dict(m) for m in d["request_messages"]),
        assistant_message=None if assistant is None else dict(assistant),
        extra=dict(d["extra"]),
        seq=_int(d["seq"], f"{where} seq") if seq is None else seq,
        lineage=_lineage(d.get("lineage"), where),  # absent in exports written before lineage
        sampling_support=_support(d.get("sampling_support"), where),
    )
    if turn.sampling_support is not None and len(turn.sampling_support) != turn.num_sampled:
        raise ExportError(f"{where}: sampling_support rows are not one per sampled id ({turn.num_sampled})")
    if d.get("weight_version") != turn.weight_version:
        raise ExportError(f"{where}: weight_version disagrees with its spans")
    return turn


def _routed_array(value: Any, where: str) -> np.ndarray | None:
    """A branch's concatenated rows: an npz array, or the JSON object with base64 data."""
    if value is None or isinstance(value, np.ndarray):
        return value
    return routed_from_json(value, where)


def _with_routed(turns: list[TurnRecord], raw: list[Any], value: Any, where: str) -> list[TurnRecord]:
    """The turns with their rows, cut from the branch's concatenation in turn order."""
    rows = _routed_array(value, where)
    wanted = [t.get("routed_experts") if isinstance(t, Mapping) else None for t in raw]
    if rows is None:
        if any(w is not None for w in wanted):
            raise ExportError(f"{where}: turns name routed experts the branch does not carry")
        return turns
    if rows.ndim != 3 or rows.dtype.kind not in "iu":
        raise ExportError(f"{where}: routed_experts must be a 3-D integer array, got {rows.dtype} {rows.shape}")
    out, pos = [], 0
    for turn, w in zip(turns, wanted, strict=True):
        if w is None:
            out.append(turn)
            continue
        n = _int(w.get("rows"), f"{where} routed rows")
        if n < 0 or pos + n > rows.shape[0]:
            raise ExportError(f"{where}: turn {turn.index} names rows past the branch's {rows.shape[0]}")
        start = _int(w.get("start"), f"{where} routed start")
        out.append(dataclasses.replace(turn, routed_experts=RoutedRows(start, rows[pos : pos + n])))
        pos += n
    if pos != rows.shape[0]:
        raise ExportError(f"{where}: {rows.shape[0] - pos} routed-experts rows belong to no turn")
    return out


def _typed(values: Any, dtype: type, name: str) -> np.ndarray:
    """A 1-D array of exactly `dtype`; lists must hold matching Python types."""
    if isinstance(values, np.ndarray):
        if values.dtype != dtype or values.ndim != 1:
            raise ExportError(
                f"{name} must be 1-D {np.dtype(dtype)}, got {values.dtype} {values.shape}"
            )
        return values
    if not isinstance(values, list):
        raise ExportError(f"{name} must be a list, got {type(values).__name__}")
    want = float if dtype is np.float32 else int
    types = set(map(type, values))
    if not types <= ({int, float} if want is float else {int}):
        raise ExportError(
            f"{name} holds {sorted(t.__name__ for t in types)}, expected {want.__name__}"
        )
    info = np.iinfo(dtype) if want is int else None
    if info is not None and values and not (info.min <= min(values) and max(values) <= info.max):
        raise ExportError(f"{name} has values outside {np.dtype(dtype)}")
    return np.array(values, dtype=dtype)


def _no_seq(t: TurnRecord) -> dict[str, Any]:
    d = turn_to_dict(t)
    del d["seq"]
    return d


class _Importer:
    """Rebuilds branches in id order, each sharing its parent's prefix."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.built: dict[int, Branch] = {}
        self.next_seq = 0  # version 1: turns numbered in (branch id, index) order

    def branch(self, meta: Mapping[str, Any], arrays: Mapping[str, Any]) -> Branch:
        where = f"branch {meta.get('id')!r}"
        bid = _int(meta["id"], f"{where} id")
        parent_id = _opt_int(meta["parent_id"], f"{where} parent_id")
        k = _int(meta["fork_checkpoint"], f"{where} fork_checkpoint")
        fork_index = _int(meta["fork_index"], f"{where} fork_index")
        ids, mask, lps = (_typed(arrays[key], dtype, f"{where} {key}") for key, dtype in _ARRAYS)
        if not ids.shape == mask.shape == lps.shape:
            raise ExportError(f"{where}: token_ids, loss_mask and logprobs differ in length")
        if parent_id is None:
            shared: list[TurnRecord] = []
            base: tuple[Any, ...] = ()
            if k or fork_index:
                raise ExportError(f"{where}: a root branch has no fork point")
        else:
            parent = self.built.get(parent_id)
            if parent is None or parent_id >= bid:
                raise ExportError(f"{where}: parent {parent_id} does not precede it")
            try:  # the checkpoint's position, or further into the parent's next prompt
                forked = parent.trajectory.fork_at(k, fork_index)
            except TrajectoryError as exc:
                raise ExportError(f"{where}: fork_index {fork_index} does not fit checkpoint {k} of its parent: "
                                  f"{exc}") from None
            shared, base = list(forked.turns), forked.segments()
        raw_turns = list(meta["turns"])
        if self.version == 1:  # a full copy of the line: check the shared part, keep the rest
            ids, mask, lps = self._own_part(where, ids, mask, lps, fork_index, base, shared, raw_turns[:k])
            raw_turns = raw_turns[k:]
        own = []
        for i, t in enumerate(raw_turns):
            seq = None
            if self.version == 1:
                seq, self.next_seq = self.next_seq, self.next_seq + 1
            own.append(_turn_from_dict(t, f"{where} turn {k + i}", seq))
        own = _with_routed(own, raw_turns, arrays.get("routed_experts"), where)
        traj = LinearTrajectory.from_parts(TokenBuffer.from_arrays(ids, lps, mask), shared + own, base=base)
        messages = traj.messages()
        if self.version != 1:
            messages = messages[traj.checkpoint_message_counts[k] :]
        if [dict(m) for m in meta["messages"]] != messages:
            raise ExportError(f"{where}: messages disagree with the turns' messages")
        reason = fork_reason_now(str(meta["reason"]), list(self.built.values()), parent_id, fork_index, own)
        self.built[bid] = branch = Branch(bid, parent_id, k, fork_index, traj, reason)
        return branch

    def _own_part(
        self, where: str, ids: np.ndarray, mask: np.ndarray, lps: np.ndarray, n: int,
        base: tuple[Any, ...], shared: list[TurnRecord], raw_shared: list[Any],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if ids.shape[0] < n:
            raise ExportError(f"{where}: {ids.shape[0]} tokens, fewer than its fork_index {n}")
        probe = LinearTrajectory()
        probe._set_base(base)
        p_ids, p_lps, p_mask = probe.arrays()
        if not (
            np.array_equal(p_ids, ids[:n])
            and np.array_equal(p_mask, mask[:n])
            and np.array_equal(p_lps.view(np.uint32), lps[:n].view(np.uint32))
        ):
            raise ExportError(f"{where}: tokens before the fork differ from the parent's")
        got = [_no_seq(_turn_from_dict(t, where, 0)) for t in raw_shared]
        if got != [_no_seq(t) for t in shared]:
            raise ExportError(f"{where}: turns before the fork differ from the parent's")
        return ids[n:], mask[n:], lps[n:]


def _tree(d: Mapping[str, Any], arrays_of: Any) -> TrajectoryTree:
    try:
        version = d.get("version")
        if d.get("format") != FORMAT or version not in _READABLE_VERSIONS:
            raise ExportError(
                f"not a {FORMAT} v{'/'.join(map(str, _READABLE_VERSIONS))} export: "
                f"{d.get('format')!r} v{version!r}"
            )
        importer = _Importer(int(version))  # type: ignore[arg-type]
        branches = [importer.branch(b, arrays_of(b)) for b in d["branches"]]
        tree = TrajectoryTree.from_branches(branches, _int(d["active_branch"], "active_branch"))
        metadata = d.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ExportError(f"metadata must be an object, got {type(metadata).__name__}")
        tree.metadata = dict(metadata)
        return tree
    except ExportError:
        raise
    except (TrajectoryError, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ExportError(f"malformed trajectory export: {type(exc).__name__}: {exc}") from exc


def branch_line(d: Mapping[str, Any], branch_id: int) -> dict[str, Any]:
    """One branch's whole line from an export dict: ``token_ids``, ``loss_mask``,
    ``logprobs`` (lists) and ``turns``, its ancestors' parts up to each fork point
    followed by its own (what version 1 exports stored per branch)."""
    tree = from_dict(d)
    traj = tree.get(branch_id).trajectory
    ids, lps, mask = traj.arrays()
    return {
        "token_ids": ids.tolist(),
        "loss_mask": mask.tolist(),
        "logprobs": lps.tolist(),
        "turns": [turn_to_dict(t) for t in traj.turns],
    }


def from_dict(d: Mapping[str, Any]) -> TrajectoryTree:
    """Rebuild a tree from `to_dict` output (possibly through a JSON round trip)."""
    if not isinstance(d, Mapping):
        raise ExportError(f"expected an object, got {type(d).__name__}")
    return _tree(d, lambda b: b)


def from_npz_bytes(data: bytes) -> TrajectoryTree:
    """Rebuild a tree from `to_npz_bytes` output."""
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
        files = {name: npz[name] for name in npz.files}
        meta = orjson.loads(files.pop("meta").tobytes())
    except (
        OSError,
        ValueError,
        KeyError,
        EOFError,
        zipfile.BadZipFile,
        orjson.JSONDecodeError,
    ) as exc:
        raise ExportError(f"not a trajectory npz: {type(exc).__name__}: {exc}") from exc
    if not isinstance(meta, dict):
        raise ExportError("npz sidecar is not a JSON object")

    def arrays_of(b: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = {key: files[f"b{b['id']}_{key}"] for key, _ in _ARRAYS}
        routed = files.get(f"b{b['id']}_routed_experts")
        if routed is not None:
            out["routed_experts"] = routed
        return out

    return _tree(meta, arrays_of)
