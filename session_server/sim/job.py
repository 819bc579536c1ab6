"""A generate request as the simulated engine's core sees it (`Job`) and what it produced
(`Outcome`), apart from the core so that the wires and the fault injector can name them
without importing the core that uses them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Job", "Outcome"]


@dataclass
class Job:
    """One generate request as the core sees it, whichever wire it came by."""

    rid: str
    input_ids: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    ignore_eos: bool
    top_k: int
    pinned_rank: int | None
    params: dict[str, Any]
    path: str
    abort: asyncio.Event = field(default_factory=asyncio.Event)
    fault: str | None = None
    cache_salt: str | None = None  # SGLang extra_key / vLLM cache_salt: a KV namespace
    rank: int = 0
    waiting: bool = False  # held by a pause before it started (the engines' waiting queue)
    produced: int = 0
    constrained: str | None = None  # the text a constraint forces (None: unconstrained)
    routed_start: int | None = None  # routing replay asked: rows from this position (None: not asked)
    stop_strs: tuple[str, ...] = ()  # stop strings, matched on the decoded output only
    # the W3C trace headers the request came with (`wire.trace_headers`), kept in the request log
    trace_headers: dict[str, str] = field(default_factory=dict)
    session: str | None = None  # the request's session tag (`x-tito-session`): its script
    seed: int | None = None  # the request's own seed (SGLang sampling_seed, vLLM seed): sampler.py


@dataclass
class Outcome:
    """What generation produced so far (or in the end), before any wire shaping."""

    ids: list[Any]
    lps: list[Any]
    tops: list[list[tuple[int, float]]] | None
    finish: str  # stop | length | abort | repetition
    matched: int | str | None  # the stop id, or the stop string
    prompt_tokens: int
    cached_tokens: int
    abort_message: str | None = None
    e2e_s: float = 0.0
    weight_version: str | None = None  # the engine's version when the output was finalised
    # the engine's version when each token was sampled, as [start, end, version] spans (vLLM
    # 0.32 reports them per request; SGLang only the version at the end)
    version_spans: list[list[Any]] = field(default_factory=list)
