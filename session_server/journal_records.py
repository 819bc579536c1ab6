"""What the journal stores for each session change, and how recovery replays it.

A record is the change itself, not the state after it, so each costs O(what changed):
a turn's record holds its new prompt ids, sampled ids, logprobs (their float32 bits),
repair ids, messages, record fields, routed experts, lineage (which agent and
thread asked for it) and sampling support (CSR int32 bytes, when the session asked),
and the branch operation that
placed it (append, rollback, fork); replaying it calls the same tree operations the
commit called (`TrajectoryTree.branch_from`, `LinearTrajectory.commit_turn`, with the
checks they make), with the turn's sequence number, so a recovered tree is the tree
that was committed, turn for turn and bit for bit. Bodies are msgpack (`msgspec`):
ints, floats, strings, bytes and containers round-trip exactly.

Kinds: `create` (config, api key, times), `turn` (with the replay log's name of the
request when it was recorded, so an SDK retry of a turn committed just before a crash
is answered from that turn, replay.py `Rerender`), `reward` (the session's reward
fields after the change: trajectory, per-leaf and per-turn rewards, metadata),
`discarded` (the count of turns that ended without a
commit, its latest value), `touch` (a read that pushed the TTL back: its time) and `response` (a Responses API object kept for
`previous_response_id`); and, for the instance (sid ""), `version`: the trainer's
weight version, kept as its latest value, so turns after a restart are labelled
with it before the trainer's next update.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from trajectory.buffer import IDS_DTYPE, LOGPROBS_DTYPE
from trajectory.codec.base import HistoryPolicy
from trajectory.history import attach, fork_reason
from trajectory.lineage import Lineage, lineage_from_dict
from trajectory.support import SupportCSR
from trajectory.tree import LEGACY_FORK_REASON, ROLLBACK_REASON, TEMPLATE_REWRITE, TrajectoryTree

from .sessions import MAX_DIAGNOSTICS, Session, SessionConfig

__all__ = ["CREATE", "DISCARDED", "INSTANCE", "TOUCH", "VERSION", "RESPONSE", "REWARD", "TURN", "Recovered", "create_body", "decode", "encode",
           "replay_rows", "reward_body", "turn_body"]

CREATE, TURN, REWARD, RESPONSE, VERSION = "create", "turn", "reward", "response", "version"
TOUCH = "touch"  # a read that pushed the TTL back: only its time matters (the latest kept)
DISCARDED = "discarded"  # the session's count of turns ended without a commit (its latest value)
INSTANCE = ""
"""The sid of instance-level records (the trainer's weight version)."""

def _plain(value: Any) -> Any:
    """What msgpack cannot carry as is, as the JSON a response would show: numpy scalars
    and arrays (a record's diagnostics may hold them), pydantic models."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"a journal record cannot hold a {type(value).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_plain)
_decoder = msgspec.msgpack.Decoder()


def encode(body: Mapping[str, Any]) -> bytes:
    return _encoder.encode(body)


def decode(body: bytes) -> Any:
    return _decoder.decode(body)


def _ids(a: Any) -> bytes:
    return np.asarray(a, dtype=IDS_DTYPE).tobytes()


def create_body(s: Session) -> bytes:
    c = s.config
    return encode({
        "token": s.token, "wall": time.time(),
        "config": {"ttl_s": c.ttl_s, "metadata": c.metadata, "max_context_tokens": c.max_context_tokens,
                   "sampling": c.sampling, "lora": c.lora, "chat_template_kwargs": c.chat_template_kwargs,
                   "history_policy": c.history_policy.value, "routing_replay": c.routing_replay,
                   "max_weight_lag": c.max_weight_lag, "sampling_policy": c.sampling_policy, "seed": c.seed,
                   "sampling_support": c.sampling_support},
    })


def turn_body(*, op: str, branch_id: int, checkpoint: int, reason: str | None, shared: int | None,
              tools: Any, seq: int, prompt_ids: Sequence[int], ids: np.ndarray, logprobs: np.ndarray,
              repair: Sequence[int], finish: str, spans: Any, version: Any, request_messages: Sequence[Any],
              assistant_message: Any, engine: str | None, cached: int, extra: Mapping[str, Any],
              routed: np.ndarray | None, answered: int | None, control: Sequence[float] | None,
              notes: Sequence[Mapping[str, Any]], recorded: Sequence[Any] | None = None,
              matched_stop: Any = None, lineage: Lineage | None = None,
              support: SupportCSR | None = None) -> bytes:
    """One committed turn (see the module doc); `op` is prepare's kind."""
    routed_part = None if routed is None else {
        "shape": list(routed.shape), "dtype": routed.dtype.str, "data": np.ascontiguousarray(routed).tobytes()}
    return encode({
        "op": op, "branch": branch_id, "checkpoint": checkpoint, "reason": reason, "shared": shared,
        "tools": tools, "seq": seq, "prompt": _ids(prompt_ids), "ids": _ids(ids),
        "lps": np.asarray(logprobs, dtype=LOGPROBS_DTYPE).tobytes(), "repair": _ids(repair),
        "finish": finish, "spans": spans, "version": version, "req": list(request_messages),
        "msg": assistant_message, "engine": engine, "cached": cached, "extra": dict(extra),
        "routed": routed_part, "answered": answered, "control": control, "notes": list(notes),
        "recorded": None if recorded is None else list(recorded), "stop": matched_stop, "wall": time.time(),
        "lineage": None if lineage is None else lineage.to_dict(),
        "support": None if support is None else {"ids": support.ids.tobytes(), "offsets": support.offsets.tobytes()},
    })


def reward_body(s: Session) -> bytes:
    return encode({"reward": s.reward, "leaf_rewards": [[k, v] for k, v in s.leaf_rewards.items()],
                   "turn_rewards": [[k, v] for k, v in s.turn_rewards.items()],
                   "reward_metadata": s.reward_metadata, "wall": time.time()})


@dataclasses.dataclass
class Recovered:
    """What a replay rebuilt, beside the sessions now in the store."""

    sessions: list[Session] = dataclasses.field(default_factory=list)  # for `SessionStore.restore`, on the loop
    turns: int = 0
    records: int = 0
    weight_version: int | None = None
    orphans: int = 0  # records of a session already closed (its create record gone with it): skipped
    # recorded requests whose turns were committed: (sid, (route, digest, key), (branch, turn), matched stop)
    answers: list[tuple[str, Any, tuple[int, int], Any]] = dataclasses.field(default_factory=list)
    responses: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)


def _session(sid: str, body: Mapping[str, Any]) -> Session:
    c = dict(body["config"])
    c["history_policy"] = HistoryPolicy(c["history_policy"])
    s = Session(sid, SessionConfig(**c), 0.0)
    s.token = body["token"]
    return s


def _apply_turn(s: Session, t: Mapping[str, Any]) -> None:
    tree = s.tree
    op, branch_id = t["op"], t["branch"]
    if op in ("first", "append"):
        tree.activate(branch_id)
    elif op == "rollback":
        tree.branch_from(branch_id, t["checkpoint"], ROLLBACK_REASON)
    else:
        tree.branch_from(branch_id, t["checkpoint"], _fork_reason(tree, t), shared=t["shared"])
    if op in ("first", "rollback", "fork"):
        s.tools_by_branch[tree.active_id] = t["tools"]
    tree.set_next_seq(t["seq"])
    routed = t["routed"]
    rows = None if routed is None else np.frombuffer(routed["data"], dtype=np.dtype(routed["dtype"])).reshape(
        routed["shape"])
    tree.active.trajectory.commit_turn(
        np.frombuffer(t["prompt"], dtype=IDS_DTYPE), np.frombuffer(t["ids"], dtype=IDS_DTYPE),
        np.frombuffer(t["lps"], dtype=LOGPROBS_DTYPE), finish_reason=t["finish"],
        weight_spans=t["spans"] or None, weight_version=None if t["spans"] else t["version"],
        repair_ids=np.frombuffer(t["repair"], dtype=IDS_DTYPE), request_messages=t["req"],
        assistant_message=t["msg"], engine=t["engine"], cached_tokens=t["cached"], extra=t["extra"],
        routed_experts=rows, lineage=lineage_from_dict(t.get("lineage")),  # absent: recorded before lineage
        sampling_support=_support(t.get("support")))
    if t["answered"] is not None:
        s.answered_seqs.add(t["answered"])
    if t["control"] is not None:
        totals = s.control_totals
        for f, v in zip(dataclasses.fields(totals), t["control"], strict=True):
            setattr(totals, f.name, getattr(totals, f.name) + v)
    for note in t["notes"]:
        if len(s.diagnostics) == MAX_DIAGNOSTICS:  # as Session.note counts what the bound pushes out
            s.diagnostics_dropped += 1
        s.diagnostics.append(note)


def _fork_reason(tree: TrajectoryTree, t: Mapping[str, Any]) -> str:
    """A fork's reason as recorded; a record written while every fork without a known
    cause, and a template's rewrite, were `history_rewrite` gets a best-effort word, from
    the tree as replayed: a template's fork shares tokens past its checkpoint (`shared`
    set), else the request is attached again to the tree as it stands at this record
    and named as prepare names it. Records replay in commit order, which is not always
    the tree prepare saw: with concurrent requests on a session, a turn committed between
    this request's prepare and its commit is already in the replayed tree, so the word
    may differ from the one live would have given (an old journal never recorded it)."""
    reason = t["reason"]
    if reason != LEGACY_FORK_REASON:
        return str(reason)
    if t["shared"] is not None:
        return TEMPLATE_REWRITE
    lineage = lineage_from_dict(t.get("lineage"))
    return fork_reason(attach(tree, t["req"]), None if lineage is None else lineage.kind)


def _support(raw: Mapping[str, bytes] | None) -> SupportCSR | None:
    """A turn's sampling support as journaled (CSR int32 bytes); None before it was asked."""
    if raw is None:
        return None
    return SupportCSR(np.frombuffer(raw["ids"], dtype=np.int32).copy(), np.frombuffer(raw["offsets"], dtype=np.int32).copy())


def control_delta(before: Any, after: Any) -> list[float] | None:
    """What a commit added to a session's `ControlTotals` (None: nothing)."""
    delta = [getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)]
    return delta if any(delta) else None


def _replay_row(row: Any, sessions: dict[str, Session], out: Recovered) -> None:
    """Apply one record (see `replay_rows`)."""
    body = decode(row.body)
    sid = row.sid
    if sid == INSTANCE:
        if row.kind == VERSION:
            out.weight_version = body["version"]
        return
    if row.kind == CREATE:
        sessions[sid] = _session(sid, body)
        return
    s = sessions.get(sid)
    if s is None:  # written after its session's tombstone deleted the rest (a reward racing a DELETE)
        out.orphans += 1
        return
    if row.kind == TURN:
        _apply_turn(s, body)
        out.turns += 1
        if body["recorded"] is not None:
            active = s.tree.active
            out.answers.append((sid, body["recorded"], (active.id, active.trajectory.num_turns - 1), body["stop"]))
    elif row.kind == REWARD:
        s.reward = body["reward"]
        s.leaf_rewards = {int(k): v for k, v in body["leaf_rewards"]}
        # per-turn rewards by seq; a record written before they existed has none
        s.turn_rewards = {int(k): v for k, v in body.get("turn_rewards", ())}
        s.reward_metadata = dict(body["reward_metadata"])
    elif row.kind == DISCARDED:
        s.turns_discarded = body["turns_discarded"]
    elif row.kind == RESPONSE:
        out.responses.append((sid, body))
    elif row.kind != TOUCH:  # a touch's time is the session's last use (replay_rows)
        raise ValueError(f"unknown kind {row.kind!r}")


def replay_rows(rows: Any, clock: Callable[[], float], *, wall: Callable[[], float] = time.time) -> Recovered:
    """Rebuild every journaled session (blocking; O(records)). Each session's last use is
    its newest record's wall time, mapped onto `clock` (the store's), so TTL deadlines
    carry over the restart. A record that does not replay raises `ValueError` (the caller
    refuses to start: a journal that does not rebuild is not served from)."""
    paused = gc.isenabled()
    gc.disable()  # millions of new objects, none of them garbage: a collection pass is pure cost here
    try:
        return _replay(rows, clock, wall)
    finally:
        if paused:
            gc.enable()


def _replay(rows: Any, clock: Callable[[], float], wall: Callable[[], float]) -> Recovered:
    out = Recovered()
    sessions: dict[str, Session] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for row in rows:
        out.records += 1
        try:
            _replay_row(row, sessions, out)
        except Exception as exc:  # a record this version cannot rebuild: the start stops, naming it
            raise ValueError(f"record {row.seq} ({row.kind} of session {row.sid!r}) does not replay: "
                             f"{type(exc).__name__}: {exc}") from exc
        if row.sid in sessions:
            first.setdefault(row.sid, row.at)
            last[row.sid] = row.at
    now_wall, now = wall(), clock()
    for sid, s in sessions.items():
        s.created_at = now - max(0.0, now_wall - first[sid])
        s.last_used = now - max(0.0, now_wall - last[sid])
    out.sessions = list(sessions.values())
    return out
