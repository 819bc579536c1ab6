"""Sampling support rules (turn/support_rules.py) against the read-out they guard."""

from __future__ import annotations

import pytest

from session_server.errors import BadRequest
from session_server.turn.support_rules import resolve_k
from trajectory.errors import ValidationError
from trajectory.support import SupportSampling, support_from_tops


def test_a_support_filling_every_top_logprob_asked_cannot_pass_when_top_k_equals_k() -> None:
    """docs/api.md "Sampling support": every support holds fewer than the k top logprobs
    asked, else 502 (how a vLLM returning raw logprobs, or ties with the top_k-th that go
    on past the k asked, are caught). With top_k = k that rule is blind: a raw-mode
    reply (no id at the floor) fills all k tops with exactly top_k ids and is stored as
    a support. Either the session is refused at creation (top_k must be < k) or such a
    support is refused at read-out; today neither happens."""
    try:
        k = resolve_k(2, {"top_k": 2, "temperature": 1.0})
    except BadRequest:
        return  # refused at creation: a full support is then always detectable
    raw = [[(5, -0.5), (9, -1.5)]]  # vLLM's default raw logprobs: no id at the floor
    assert k is not None
    with pytest.raises(ValidationError):
        support_from_tops(raw, [5], rule="processed", sampling=SupportSampling(top_k=2), asked=k)
