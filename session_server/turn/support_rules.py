"""Sampling support capture: what a session that asks for it may sample with, and its
turns' supports read out of the engine's top logprobs (`trajectory.support`).

A trainer replays the support only if the sampler's distribution is a function of the
logits and the truncation alone: penalties (presence / frequency / repetition) depend
on the whole history and `logit_bias` on the client, so a session asking for support
refuses them at creation and in every turn, as vLLM's sampling replay refuses what it
cannot bound (`v1/engine/input_processor.py`, 0.32: temperature > 0 and top_k > 0).
Its truncation (temperature, top_k, top_p, min_p) is pinned by the session's
`sampling` at creation: a turn that asks for another is a 400 naming the field, so one
session's supports all come from one rule. top_k bounds the support (at most k ids a
token, <= 4k + 4 bytes with its offset) and must be at most the top logprobs asked (k).
"""

from __future__ import annotations

from typing import Any

from trajectory.errors import ValidationError
from trajectory.support import (
    MAX_SUPPORT_K,
    SupportCSR,
    SupportRule,
    SupportSampling,
    support_from_tops,
)

from ..errors import BadRequest, UpstreamInvalid
from .chat_request import PINNED_FIELDS, ChatRequest

__all__ = ["PINNED", "REFUSED", "check_turn", "resolve_k", "support_of"]

REFUSED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
PINNED = ("temperature", "top_k", "top_p", "min_p")


def resolve_k(asked: bool | int | None, sampling: dict[str, Any]) -> int | None:
    """The session's support k (None: not asked), or a 400 naming what cannot be replayed."""
    if asked is None or asked is False:
        return None
    k = MAX_SUPPORT_K if asked is True else int(asked)
    if not 1 <= k <= MAX_SUPPORT_K:
        raise BadRequest(f"sampling_support: k must be in [1, {MAX_SUPPORT_K}] (the engines' top logprobs), got {k}")
    for name in REFUSED:
        if sampling.get(name) is not None:
            raise BadRequest(f"sampling.{name}: a session with sampling_support cannot replay {name}")
    top_k = sampling.get("top_k")
    if top_k is None or not 1 <= top_k < k:  # the k-th top logprob shows where the support ends
        raise BadRequest(f"sampling.top_k: a session with sampling_support k={k} needs top_k in [1, {k - 1}] "
                         f"(top_k bounds the support; one more top logprob than top_k tells a full support "
                         f"from one the engine did not truncate), got {top_k}")
    if sampling.get("temperature") == 0:
        raise BadRequest("sampling.temperature: a session with sampling_support needs temperature > 0")
    return k


def check_turn(sampling: dict[str, Any], req: ChatRequest, *, pinned: bool = False) -> None:
    """A 400 naming the field when a turn of a support session asks what its session
    cannot replay: a penalty, `logit_bias`, or a truncation other than the pinned one.
    Under the `pinned` sampling policy the client's distribution fields never reach the
    engine (the session's are sent; the turn records the client's), so only what the
    policy does not cover, `logit_bias`, is refused."""
    extra = req.model_extra or {}
    for name in REFUSED:
        if pinned and name in PINNED_FIELDS:
            continue
        value = getattr(req, name, None) if name in type(req).model_fields else extra.get(name)
        if value is not None:
            raise BadRequest(f"{name}: this session captures its sampling support and cannot replay {name}")
    for name in () if pinned else PINNED:
        value = getattr(req, name)
        if value is not None and value != sampling.get(name):
            raise BadRequest(f"{name}: this session's sampling is pinned at creation for its sampling support "
                             f"({name}={sampling.get(name)!r}); the turn asked {value!r}")


def support_of(tops: Any, ids: Any, rule: SupportRule | None, sampling: dict[str, Any], asked: int) -> SupportCSR:
    """The turn's supports, one row per sampled id; bad engine output is a 502."""
    if rule is None:
        raise UpstreamInvalid("sampling_support: the engine that generated this turn cannot report it")
    if tops is None:
        raise UpstreamInvalid("engine output rejected: sampling_support needs the top logprobs of every token")
    pinned = SupportSampling(
        top_k=int(sampling["top_k"]),
        top_p=float(sampling.get("top_p") or 1.0),  # top_p is > 0 when set
        min_p=float(sampling.get("min_p") or 0.0),
    )
    try:
        return support_from_tops(tops, ids, rule=rule, sampling=pinned, asked=asked)
    except ValidationError as exc:
        raise UpstreamInvalid(f"engine output rejected: {exc}") from exc
