"""The routing policy contract: what a policy sees, what it returns, and its hooks.

A policy is a pure object: it sees immutable `TargetView`s and an injected clock
value (inside one `RoutingSignals`) and returns a target id, so the same code runs
in the server (`pool.py`) and in the discrete-event simulator
(`bench/routing_sim.py`). One required method, `select`, and two declared
attributes: `name`, and `needs_prefix_hashes` (whether it reads the one signal that
costs a pass over the prompt); optional hooks have no-op defaults in `PolicyBase`.
New signals are new optional fields of `RoutingSignals`, never new parameters. Each
policy lives in its own module whose name equals the policy's `name` and its config
tag (`factory.make_policy`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

PREFIX_BLOCK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class TargetView:
    """One (engine, dp_rank) target as a policy sees it at decision time."""

    id: str
    healthy: bool
    in_flight: int
    sessions: int
    resident_tokens: int = 0
    pending_prefill_tokens: int = 0
    kv_capacity_tokens: int | None = None
    engine_id: str = ""
    # requests the engine reports on this rank beyond this instance's own in-flight ones
    # (other instances' work, learned from the engine): placement adds it
    external_load: int = 0

    @property
    def placement_load(self) -> int:
        """In-flight work a new session would queue behind: ours plus what the engine
        reports from other instances (stays `in_flight` when load learning is off)."""
        return self.in_flight + self.external_load


@dataclass(frozen=True, slots=True)
class RoutingSignals:
    """Everything a policy may use for one decision; every signal past `targets` is optional.

    `context_tokens` is the full prompt length of this turn; `prefix_hashes` is
    `prefix_block_hashes(prompt_ids)`, computed only for a policy that
    `needs_prefix_hashes` (`cache_aware`).
    """

    session_id: str
    home: str | None
    targets: Sequence[TargetView]
    now_s: float = 0.0
    context_tokens: int | None = None
    prefix_hashes: Sequence[int] | None = None


class RoutingPolicy(Protocol):
    name: str
    # the policy reads `RoutingSignals.prefix_hashes`: only then does the caller pay for
    # hashing the whole prompt (`prefix_block_hashes`) on every turn
    needs_prefix_hashes: bool

    def select(self, signals: RoutingSignals) -> str | None:
        """Target id for this session's next turn, or None when no target is healthy."""
        ...

    def on_turn_complete(self, session_id: str, target_id: str, now_s: float) -> None:
        """A turn routed to `target_id` finished (successfully or not)."""
        ...

    def on_target_added(self, target_id: str) -> None: ...

    def on_target_removed(self, target_id: str) -> None: ...


class PolicyBase:
    """No-op defaults for the optional hooks; policies override what they need."""

    name = "base"
    needs_prefix_hashes = False

    def on_turn_complete(self, session_id: str, target_id: str, now_s: float) -> None:
        return None

    def on_target_added(self, target_id: str) -> None:
        return None

    def on_target_removed(self, target_id: str) -> None:
        return None


def healthy_targets(signals: RoutingSignals) -> list[TargetView]:
    return [t for t in signals.targets if t.healthy]


def home_if_healthy(signals: RoutingSignals) -> TargetView | None:
    if signals.home is None:
        return None
    for t in signals.targets:
        if t.id == signals.home:
            return t if t.healthy else None
    return None


def stable_hash(key: str) -> int:
    """A process-independent 64-bit hash (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def rendezvous_score(session_id: str, target_id: str) -> int:
    """Highest-random-weight hash: stable per (session, target), spread across targets."""
    return stable_hash(f"{session_id}|{target_id}")


def prefix_block_hashes(
    token_ids: Sequence[int] | NDArray[np.int32], block_tokens: int = PREFIX_BLOCK_TOKENS
) -> tuple[int, ...]:
    """Chained hashes of whole `block_tokens` blocks: equal i-th hashes imply equal prefixes.

    hash_i = H(hash_{i-1}, tokens[i*B:(i+1)*B]); a trailing partial block is not hashed.
    """
    # one int32-LE buffer for the whole context (numpy, no per-token Python ints): the
    # same bytes the per-token encoding produced, so the hashes are unchanged
    data = np.ascontiguousarray(np.asarray(token_ids), dtype="<i4").data.cast("B")
    step = 4 * block_tokens
    out: list[int] = []
    prev = b""
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(data[start : start + step])
        digest = h.digest()
        out.append(int.from_bytes(digest, "big"))
        prev = digest
    return tuple(out)
