"""Deterministic routed experts for the simulated engines (routing replay tests).

Position ``p``'s expert at layer ``l``, slot ``k`` is a function of (token id at
``p``, ``p``, ``l``, ``k``) only (`expert_id`), so a test recomputes what any
segment of any turn must have returned. Payloads follow the real wire shapes
(session_server/routed.py, docs/engines.md): SGLang base64 int32, flat, rows
``[start, prompt + output - 1)``; vLLM base64 of ``.npy`` bytes, shape
``(num_tokens - 1, layers, topk)``, covering the whole sequence from position 0.

Routed-experts faults (`ROUTED_FAULTS`, queued like every other fault with
``POST /sim/faults``) bend one answer's rows so the server's gap and shape checks
can be tested on a wire-shaped lie.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_ROUTED", "ROUTED_FAULTS", "RoutedSpec", "line_rows", "model_spec", "sglang_payload",
           "vllm_payload"]

# fault kinds that act on the routed experts of the answer they land on
ROUTED_FAULTS = {
    "routed_extra_row": "one row more than the positions asked",
    "routed_missing_row": "one row fewer than the positions asked",
    "routed_layers": "one MoE layer fewer in every row (a shape the session has not seen)",
    "routed_out_of_range": "the last id is num_experts (outside [0, num_experts))",
}


@dataclass(frozen=True)
class RoutedSpec:
    layers: int = 4
    topk: int = 2
    num_experts: int = 16


DEFAULT_ROUTED = RoutedSpec()


def model_spec(name_or_path: str) -> RoutedSpec:
    """The simulated MoE of the model the engine serves, as SGLang sizes its routed-experts
    capture: `hf_text_config.num_hidden_layers` x `num_experts_per_tok` of the model's
    config.json (sgl-project/sglang python/sglang/srt/layers/moe/routed_experts_capturer.py);
    `DEFAULT_ROUTED` for a model without one (a bare tokenizer, a dense config). The
    expert count, when the config has none, is the default's (at least topk)."""
    from session_server.model_config import model_routed_shape

    shape = model_routed_shape(name_or_path)
    if shape is None:
        return DEFAULT_ROUTED
    layers, topk, experts = shape
    return RoutedSpec(layers=layers, topk=topk, num_experts=experts or max(DEFAULT_ROUTED.num_experts, topk))


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


def faulted_rows(ids: Sequence[int] | np.ndarray, spec: RoutedSpec, start: int, fault: str | None) -> np.ndarray:
    """`line_rows`, bent as a routed-experts fault says (`ROUTED_FAULTS`; other kinds: as is)."""
    rows = line_rows(ids, spec, start)
    if fault == "routed_extra_row":
        rows = np.concatenate([rows, rows[-1:] if len(rows) else np.zeros((1, spec.layers, spec.topk), np.int32)])
    elif fault == "routed_missing_row" and len(rows):
        rows = rows[:-1]
    elif fault == "routed_layers":
        rows = np.ascontiguousarray(rows[:, : max(1, spec.layers - 1)])
    elif fault == "routed_out_of_range" and rows.size:
        rows = rows.copy()
        rows.flat[-1] = spec.num_experts
    return rows


def sglang_payload(ids: Sequence[int] | np.ndarray, spec: RoutedSpec, start: int, fault: str | None = None) -> str:
    """SGLang's `meta_info.routed_experts`: base64 of the flat int32 rows from `start`."""
    return base64.b64encode(faulted_rows(ids, spec, start, fault).tobytes()).decode()


def vllm_payload(ids: Sequence[int] | np.ndarray, spec: RoutedSpec, fault: str | None = None) -> str:
    """vLLM's choice `routed_experts`: base64 of ``.npy`` bytes, ``(len(ids) - 1, layers,
    topk)`` from position 0, in the smallest of uint8 / uint16 / int32 holding the ids."""
    rows = faulted_rows(ids, spec, 0, fault)
    top = int(rows.max()) if rows.size else 0
    dtype = np.uint8 if top < 256 else np.uint16 if top < 65536 else np.int32
    buf = io.BytesIO()
    np.save(buf, rows.astype(dtype), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()
