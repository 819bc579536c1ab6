"""`POST /samples` over the instances of a cluster: the receiving one gathers the batch.

A trainer holds one URL (the proxy's), and a realistic batch holds sessions of every
instance, each living in its own instance's memory. The instance a batch lands on
serves its own sessions and asks each session's owner (its peer, found by the
instance id that prefixes every session id and that each peer's `/health` names) for
the others, over the relay's client (control/relay.py: relayed marker, admin token).

The batch stays all or nothing before the first byte: every owner validates its part
first (`POST /samples?check=1`, relayed: the same checks as a local batch, unknown id
404, `close` with a turn in flight 409, nothing read or closed), concurrently. Then
the batch streams in its own order; each foreign session is fetched from its owner
as a one-session batch in safetensors (exact round trip: dtypes, float32 bits, `1`
vs `1.0` versions), with `close` (so the owner closes it, as it would its own), and
handed to this response's writer in the asked format: the payload is the one a
single instance holding every session would send. A peer that is down, fails, or no
longer has a session once streaming began breaks the stream (the connection closes
before the body ends, so a client never takes a partial batch for a whole one).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import aiohttp
import orjson

from trajectory.sample_formats import load_samples_safetensors
from trajectory.samples import Sample

from ..context import ServerContext
from ..control.relay import PeerRelay
from ..errors import InstanceUnavailable, SessionNotFound, from_peer
from ..sessions import instance_of
from .models import SamplesBatch

__all__ = ["CHECK_PATH", "Peers", "plan"]

CHECK_PATH = "/samples?check=1"


class Peers:
    """Where each foreign session of one batch lives, and how to read it from there."""

    def __init__(self, relay: PeerRelay, spec: SamplesBatch, authorization: str | None,
                 owners: dict[str, tuple[str, str]]) -> None:
        self.relay = relay
        self.spec = spec
        self.authorization = authorization
        self.owners = owners  # session id -> (instance, peer URL)

    def _body(self, ids: list[str], fmt: str) -> bytes:
        return orjson.dumps({**self.spec.model_dump(), "session_ids": ids, "format": fmt})

    async def _post(self, sid: str, path: str, body: bytes) -> bytes:
        instance, peer = self.owners[sid]
        try:
            status, raw = await self.relay.post(peer, path, body, authorization=self.authorization)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise InstanceUnavailable(
                f"instance {instance} ({peer}), which holds session {sid!r} of this batch, did not answer: "
                f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        if status != 200:
            try:
                reply: Any = orjson.loads(raw)
            except orjson.JSONDecodeError:
                reply = raw[:300].decode("utf-8", "replace")
            raise from_peer(status, reply)
        return raw

    async def check(self) -> None:
        """Every owner validates its part at once; the first failure (batch order) is raised."""
        groups: dict[str, list[str]] = defaultdict(list)
        for sid, (instance, _) in self.owners.items():
            groups[instance].append(sid)
        outcomes = await asyncio.gather(
            *(self._post(ids[0], CHECK_PATH, self._body(ids, self.spec.format)) for ids in groups.values()),
            return_exceptions=True)
        for out in outcomes:
            if isinstance(out, BaseException):
                raise out

    async def samples(self, ctx: ServerContext, sid: str) -> list[Sample]:
        """One foreign session's samples, read (and closed, with `close`) by its owner."""
        raw = await self._post(sid, "/samples", self._body([sid], "safetensors"))
        return await ctx.offload.run(load_samples_safetensors, raw)


async def plan(ctx: ServerContext, spec: SamplesBatch, relay: PeerRelay, authorization: str | None) -> Peers | None:
    """The batch's foreign sessions mapped to their owners and checked there (module
    doc); None when every session is this instance's own."""
    mine = ctx.store.instance_id
    foreign = {sid: owner for sid in spec.session_ids
               if mine is not None and (owner := instance_of(sid)) is not None and owner != mine}
    if not foreign:
        return None
    urls, silent = await relay.instances()
    if not set(foreign.values()) <= set(urls):
        urls, silent = await relay.instances(refresh=True)
    for sid, owner in foreign.items():
        if owner not in urls:
            if silent:
                raise InstanceUnavailable(f"session {sid!r} names instance {owner!r}, and peers {', '.join(silent)} "
                                          "did not answer (down or starting): nothing was read or closed")
            raise SessionNotFound(f"unknown session {sid!r}: it names instance {owner!r}, which is not in this "
                                  f"cluster (instances: {', '.join(sorted([*urls, str(mine)]))})")
    peers = Peers(relay, spec, authorization, {sid: (owner, urls[owner]) for sid, owner in foreign.items()})
    await peers.check()
    return peers
