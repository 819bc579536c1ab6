"""Deterministic routed experts for the simulated engines (routing replay tests).

Position ``p``'s expert at layer ``l``, slot ``k`` is a function of (token id at
``p``, ``p``, ``l``, ``k``) only (`expert_id`), so a test recomputes what any
segment of any turn must have returned. Payloads follow the real wire shapes
(session_server/routed.py): SGLang base64 int32, flat, rows
``[start, prompt + output - 1)``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_ROUTED", "RoutedSpec", "line_rows", "sglang_payload"]


@dataclass(frozen=True)
class RoutedSpec:
    layers: int = 4
    topk: int = 2
    num_experts: int = 16


DEFAULT_ROUTED = RoutedSpec()


def line_rows(ids: Sequence[int] | np.ndarray, spec: RoutedSpec, start: int = 0) -> np.ndarray:
    """int32 rows for positions ``[start, len(ids) - 1)`` of the sequence `ids`."""
    arr = np.asarray(ids, dtype=np.int64)
    n = max(0, len(arr) - 1 - start)
    pos = np.arange(start, start + n, dtype=np.int64)[:, None, None]
    tok = arr[start : start + n][:, None, None]
    layer = np.arange(spec.layers, dtype=np.int64)[None, :, None]
    k = np.arange(spec.topk, dtype=np.int64)[None, None, :]
    base = tok * 1_000_003 + pos * 7919 + layer * 104_729
    return ((base + k * (spec.num_experts // max(1, spec.topk) or 1)) % spec.num_experts).astype(np.int32)


def sglang_payload(ids: Sequence[int] | np.ndarray, spec: RoutedSpec, start: int) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of the flat int32 rows."""
    return base64.b64encode(line_rows(ids, spec, start).tobytes()).decode()
