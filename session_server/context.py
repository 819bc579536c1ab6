"""The process-wide context every route and the turn pipeline share (and its `Settings`)."""

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
from .settings import Settings

__all__ = ["ServerContext", "Settings", "log"]

log = logging.getLogger("session_server")


@dataclass
class ServerContext:
    settings: Settings
    store: SessionStore
    offload: CpuOffload
    metrics: Metrics
    codec: ChatCodec
    tokenizer: Any
    vocab_size: int  # the model's rows: the bound on sampled ids (model_config.py), >= the tokenizer's
    engines: EnginePool  # routing bookkeeping (targets, load, homes)
    registry: EngineRegistry  # engine lifecycle and adapters: the only way to an engine
    decoder: ReplyDecoder
    control: ControlPlane
    admission: PrefillAdmission = field(default_factory=PrefillAdmission)
