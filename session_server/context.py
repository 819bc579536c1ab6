"""The process-wide context every route and the turn pipeline share (and its `Settings`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from trajectory.codec.base import ChatCodec

from .control import ControlPlane
from .engines.registry import EngineRegistry
from .engines.reply_decoder import ReplyDecoder
from .journal import Journal
from .metrics import Metrics
from .offload import CpuOffload
from .routed import RoutedShape
from .routing.admission import PrefillAdmission
from .routing.pool import EnginePool
from .sessions import SessionStore
from .settings import Settings
from .tracing import Tracing

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
    pool: EnginePool  # routing bookkeeping (targets, load, homes)
    registry: EngineRegistry  # engine lifecycle and adapters: the only way to an engine
    decoder: ReplyDecoder
    control: ControlPlane
    admission: PrefillAdmission = field(default_factory=PrefillAdmission)
    # routed-experts (layers, topk, experts) of the config.json beside the tokenizer (model_config.py)
    model_routed: tuple[int, int, int | None] | None = None
    journal: Journal | None = None  # the session journal (settings.journal_dir; None: sessions die with the process)
    tracing: Tracing | None = None  # OpenTelemetry traces of turns (settings.otel_endpoint; None: off)

    def routed_shape(self) -> RoutedShape:
        """What the server knows of the model's routed experts: each setting, else the
        config of the model an engine serves, else the config beside the tokenizer."""
        s = self.settings
        layers, topk, experts = self.registry.routed_shape() or self.model_routed or (None, None, None)
        return RoutedShape(layers=s.routed_experts_layers or layers, topk=s.routed_experts_topk or topk,
                           num_experts=s.routed_experts_num_experts or experts)
