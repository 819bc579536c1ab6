"""Settings and the process-wide context every route and the turn pipeline share."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from trajectory.codec.base import ChatCodec

from .control import ControlPlane
from .engines.registry import EngineRegistry
from .metrics import Metrics
from .offload import CpuOffload
from .reply_decoder import ReplyDecoder
from .routing.admission import PrefillAdmission
from .routing.pool import EnginePool
from .sessions import SessionStore

log = logging.getLogger("session_server")


@dataclass
class Settings:
    cpu_workers: int | None = None
    default_max_tokens: int = 1024
    turn_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_sessions: int = 100_000
    default_ttl_s: float = 3600.0
    max_branches: int = 64  # per session; each retry/fork copies its prefix (429 branch_limit past it)
    sweep_interval_s: float = 5.0
    drain_timeout_s: float = 30.0
    clamp_logprob_sentinel: bool = False
    routing_policy: str = "sticky_cost"
    prefill_slots_per_engine: int = 1
    large_prefill_tokens: int = 16384
    health_probe_interval_s: float = 2.0
    pause_grace_s: float = 0.05
    decode_processes: int = 1  # worker processes for large engine replies (0: threads only)
    admin_token: str | None = None  # None: auth off; else bearer auth on (see auth.py)
    instance_id: str | None = None  # what /health reports; None: random per process


@dataclass
class ServerContext:
    settings: Settings
    store: SessionStore
    offload: CpuOffload
    metrics: Metrics
    codec: ChatCodec
    tokenizer: Any
    engines: EnginePool  # routing bookkeeping (targets, load, homes)
    registry: EngineRegistry  # engine lifecycle and adapters: the only way to an engine
    decoder: ReplyDecoder
    control: ControlPlane
    admission: PrefillAdmission = field(default_factory=PrefillAdmission)
