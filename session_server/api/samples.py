"""Training samples over HTTP: one session's, a streamed batch's, and rewards.

The library (`trajectory.samples.build_samples`, `trajectory.sample_formats`) does the
work; this module decides what each session contributes and where it runs:

* every sample's `metadata` is the session's creation metadata, then the metadata of
  its reward posts merged over it, then ``session_id`` (set by the server; clients
  cannot send any key the server owns: `api.models.SAMPLE_METADATA_RESERVED`);
* its `reward` is the leaf's own reward when one was posted with ``leaf`` and that
  branch still holds a leaf, else the session's trajectory-level reward (or None);
  its `turn_rewards` are the rewards posted per turn (a turn named by its seq,
  `trajectory.turn_rewards`), None for a turn without one; its `turn_lineage` the agent
  each turn came from; ``agent`` / ``agent_kind`` select by it (`trajectory.samples`);
* samples are built under the session's lock (a commit must not mutate the tree
  while the offload thread reads it) on the CPU offload threads, and serialized
  there after the lock is released.

A batch (`POST /samples`) is validated whole before a byte is sent (unknown id: 404;
``close`` with a turn in flight: 409), then streamed one session at a time: build,
hand to the format's batch writer, drop, yield to the loop. Only one session's
samples are alive at once; npz and safetensors spool the arrays
(`trajectory.sample_batch.SampleBatchWriter`). In a cluster the instance a batch
lands on gathers the other instances' sessions from their owners (samples_cluster.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Container
from typing import Any

from fastapi.responses import Response, StreamingResponse

from trajectory.errors import SampleError
from trajectory.lineage import AgentFilter
from trajectory.sample_batch import BATCH_WRITERS, SampleBatchWriter
from trajectory.sample_formats import MEDIA_TYPES, SERIALIZERS
from trajectory.samples import DEFAULT_PICKER, PICKERS, Sample, build_samples, tree_lines
from trajectory.turn_rewards import committed_seqs

from ..context import ServerContext
from ..control.relay import PeerRelay
from ..errors import BadRequest, JournalUnavailable, SessionBusy, from_library
from ..journal import durable
from ..journal_records import REWARD, reward_body
from ..sessions import Session, SessionState
from . import samples_cluster
from .models import RewardRequest, SamplesBatch
from .samples_cluster import Peers

__all__ = ["DEFAULT_PICKER", "batch_response", "check_batch", "reward_view", "session_response", "set_reward"]


def sample_metadata(s: Session) -> dict[str, Any]:
    """What every sample of `s` carries as `metadata` (server-owned keys last: they win)."""
    return {**s.config.metadata, **s.reward_metadata, "session_id": s.id, "sampling": sampling_view(s)}


def sampling_view(s: Session) -> dict[str, Any]:
    """The session's sampling as every sample carries it: the policy, the session's values
    and its seed (each turn's own values are in its diagnostics' `sampling`)."""
    c = s.config
    return {"policy": c.sampling_policy, "values": dict(c.sampling), "seed": c.seed}


def reward_view(s: Session) -> dict[str, Any]:
    """The rewards posted so far (session view and the reward answer); leaf ids and turn
    seqs as JSON keys."""
    return {"reward": s.reward, "leaf_rewards": {str(k): v for k, v in sorted(s.leaf_rewards.items())},
            "turn_rewards": {str(k): v for k, v in sorted(s.turn_rewards.items())}}


def session_samples(s: Session, picker: str, max_seq_len: int | None,
                    agent: AgentFilter | None = None) -> list[Sample]:
    """The samples of one session (with `agent`: the lines of that agent's turns, only
    those trained, `trajectory.samples`); runs on an offload thread under `s.lock`."""
    reward: float | dict[int, float | None] | None = s.reward
    if s.leaf_rewards:  # a per-leaf reward only while its branch still holds a leaf
        reward = {leaf: s.leaf_rewards.get(leaf, s.reward) for leaf in tree_lines(s.tree).leaves}
    try:
        return build_samples(s.tree, picker=picker, max_seq_len=max_seq_len, reward=reward, metadata=sample_metadata(s),
                             turn_rewards=s.turn_rewards, agent=agent)
    except SampleError as exc:  # the routes validate first; this is the backstop
        raise from_library(exc) or BadRequest(str(exc)) from exc


async def _built(ctx: ServerContext, s: Session, picker: str, max_seq_len: int | None,
                 agent: AgentFilter) -> list[Sample]:
    async with s.lock:
        return await ctx.offload.run(session_samples, s, picker, max_seq_len, agent)


def check_picker(picker: str) -> None:
    if picker not in PICKERS:
        raise BadRequest(f"unknown picker {picker!r}; known: {sorted(PICKERS)}")


async def session_response(
    ctx: ServerContext, s: Session, fmt: str, picker: str, max_seq_len: int | None,
    agent: AgentFilter | None = None,
) -> Response:
    """`GET /sessions/{sid}/samples`: the session's samples as one payload."""
    check_picker(picker)
    samples = await _built(ctx, s, picker, max_seq_len, agent or AgentFilter())
    payload = await ctx.offload.run(SERIALIZERS[fmt], samples)
    return Response(content=payload, media_type=MEDIA_TYPES[fmt])


def _leaves(s: Session) -> list[int]:
    return tree_lines(s.tree).leaves


def _check_turns(s: Session, spec: RewardRequest) -> None:
    """Every turn the request names is a committed turn of `s` (a 400 naming the field)."""
    changes = spec.turn_changes()
    if not changes:
        return
    seqs = committed_seqs(s.tree.branches())
    for where, seq, _ in changes:
        if seq not in seqs:
            raise BadRequest(f"{where}: {seq} is not the seq of a committed turn of session {s.id} "
                             f"(committed seqs: {min(seqs)} to {max(seqs)})" if seqs else
                             f"{where}: session {s.id} has no committed turn")


def _reward_body(s: Session) -> dict[str, Any]:
    return {"session_id": s.id, **reward_view(s), "metadata": sample_metadata(s)}


async def set_reward(ctx: ServerContext, s: Session, spec: RewardRequest) -> dict[str, Any]:
    """`POST /sessions/{sid}/reward`: store a trajectory-level, per-leaf or per-turn
    reward (or several turns' at once) and merge metadata; null unsets (the session's
    reward, that leaf's override, that turn's reward); setting again replaces. A request
    naming a turn or leaf that is not there changes nothing (all or none)."""
    if ctx.journal is not None:
        ctx.journal.check_writable()
    async with s.lock:  # the leaf and turn checks read the tree; samples read these fields under it
        before = (s.reward, dict(s.leaf_rewards), dict(s.turn_rewards), dict(s.reward_metadata))
        if s.state is not SessionState.ACTIVE:  # deleted while this waited for the lock
            ctx.store.get(s.id)  # its 410 or 404 before any check of what it named
        if spec.leaf is not None:
            leaves = await ctx.offload.run(_leaves, s)
            if spec.leaf not in leaves:
                raise BadRequest(f"leaf {spec.leaf} is not a leaf branch of session {s.id} (leaves: {leaves})")
        await ctx.offload.run(_check_turns, s, spec)
        if s.state is not SessionState.ACTIVE:  # deleted while this waited (a DELETE takes no lock)
            ctx.store.get(s.id)  # its 410 (a tombstone) or 404: the reward went nowhere
        if spec.leaf is not None:
            if spec.reward is None:
                s.leaf_rewards.pop(spec.leaf, None)
            else:
                s.leaf_rewards[spec.leaf] = float(spec.reward)
        elif spec.sets_session_reward():
            s.reward = None if spec.reward is None else float(spec.reward)
        for _, seq, value in spec.turn_changes():
            if value is None:
                s.turn_rewards.pop(seq, None)
            else:
                s.turn_rewards[seq] = float(value)
        s.reward_metadata.update(spec.metadata)
        if ctx.journal is not None:  # the state after the change, durable before it is answered
            written = ctx.journal.append(s.id, REWARD, reward_body(s))
            try:
                await durable(written)
            except JournalUnavailable:
                s.reward, s.leaf_rewards, s.turn_rewards, s.reward_metadata = before
                raise
        return await ctx.offload.run(_reward_body, s)


def _validated(ctx: ServerContext, spec: SamplesBatch, foreign: Container[str] = ()) -> list[Session]:
    """Every session of the batch held here (all but `foreign`), or the error, before
    anything is streamed."""
    sessions = [ctx.store.get(sid) for sid in spec.session_ids if sid not in foreign]  # 404 on the first unknown
    if spec.close:
        busy = [s.id for s in sessions if s.inflight is not None]
        if busy:
            raise SessionBusy(f"{len(busy)} session(s) have a chat in flight, e.g. {busy[0]}; nothing read or closed")
    for s in sessions:
        ctx.store.touch(s)  # reading is using: none expires while the batch streams
    return sessions


async def _stream(ctx: ServerContext, sessions: list[Session], spec: SamplesBatch,
                  peers: Peers | None) -> AsyncIterator[bytes]:
    writer: SampleBatchWriter = BATCH_WRITERS[spec.format]()
    here = iter(sessions)
    try:
        if head := writer.head():
            yield head
        for sid in spec.session_ids:  # the batch's order, wherever each session lives
            if peers is not None and sid in peers.owners:
                samples = await peers.samples(ctx, sid)
            else:
                s = next(here)
                samples = await _built(ctx, s, spec.picker, spec.max_seq_len, spec.agent_filter())
                if spec.close and s.state is SessionState.ACTIVE:
                    ctx.store.close(s.id, "taken by POST /samples with close")
                    if ctx.journal is not None:  # its tombstone is stored before its samples are sent
                        with contextlib.suppress(JournalUnavailable):  # logged; it may come back at a restart
                            await durable(ctx.journal.barrier())
            part = await ctx.offload.run(writer.add, samples)
            del samples
            if part:
                yield part
            await asyncio.sleep(0)  # other requests run between sessions
        chunks = writer.chunks()
        while (chunk := await ctx.offload.run(next, chunks, None)) is not None:
            yield chunk
    finally:
        writer.close()


async def check_batch(ctx: ServerContext, spec: SamplesBatch, relay: PeerRelay | None = None,
                      authorization: str | None = None) -> dict[str, Any]:
    """`POST /samples?check=1`: the batch validated as it would be for reading, nothing
    read or closed. A peer's relayed check (samples_cluster.py) covers this instance's
    part; a client's (with `relay`) the whole batch, on every owner, as one instance
    answers it for a batch it holds whole."""
    peers = await samples_cluster.plan(ctx, spec, relay, authorization) if relay is not None else None
    return {"ok": True, "sessions": len(_validated(ctx, spec, peers.owners if peers is not None else ())) +
            (len(peers.owners) if peers is not None else 0)}


async def batch_response(
    ctx: ServerContext, spec: SamplesBatch, relay: PeerRelay | None = None, authorization: str | None = None,
) -> StreamingResponse:
    """`POST /samples`: validate every id now, here and (with `relay`) on the owners of
    the other instances' sessions (errors are answered whole), then stream."""
    peers = await samples_cluster.plan(ctx, spec, relay, authorization) if relay is not None else None
    sessions = _validated(ctx, spec, peers.owners if peers is not None else ())
    return StreamingResponse(_stream(ctx, sessions, spec, peers), media_type=MEDIA_TYPES[spec.format])
