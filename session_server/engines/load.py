"""The load an engine reports about itself, as requests per DP rank.

N server instances share the engines and tell each other nothing; each learns what the
others put on an engine from the engine itself, and placement of new sessions adds it
to its own in-flight count (`routing/pool.py`, `EnginePool.set_engine_load`).

- SGLang `GET /get_load`: a JSON list, one entry per DP rank, of
  `{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", ...}` (sglang
  `python/sglang/srt/entrypoints/http_server.py` `get_load`, backed by the
  scheduler's `get_load`, where `num_reqs` is running + waiting and
  `num_waiting_reqs` the waiting part of it). Newer builds keep that shape as a shim
  over `/v1/loads`, whose entries give `num_running_reqs` and `num_waiting_reqs`
  separately; both shapes are read.
- vLLM `GET /metrics` (Prometheus text): the gauges `vllm:num_requests_running` and
  `vllm:num_requests_waiting`, one sample per DP rank labelled `engine="<rank>"`.
  Parsed with prometheus_client's text parser, off the event loop (the adapter's offload):
  a large deployment's exposition runs to hundreds of KB.

A rank's load is running + waiting requests: both are work the engine has taken that a
new session would queue behind.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["VLLM_LOAD_GAUGES", "sglang_load", "vllm_load"]

VLLM_LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0


def sglang_load(reply: Any) -> dict[int, int]:
    """Requests per DP rank from SGLang's `/get_load` (or `/v1/loads`: `{"loads": [...]}`)."""
    entries = reply.get("loads") if isinstance(reply, dict) else reply
    out: dict[int, int] = {}
    if not isinstance(entries, list):
        return out
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            continue
        rank = e.get("dp_rank", i)
        rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else i
        if "num_reqs" in e:  # already running + waiting
            n = _count(e["num_reqs"])
        else:
            n = _count(e.get("num_running_reqs")) + _count(e.get("num_waiting_reqs"))
        out[rank] = out.get(rank, 0) + n
    return out


def vllm_load(body: bytes | str) -> dict[int, int]:
    """Requests per DP rank from vLLM's `/metrics` text (running + waiting gauges)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    out: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in VLLM_LOAD_GAUGES:
                continue
            label = sample.labels.get("engine", "0")
            rank = int(label) if label.isdigit() else 0
            out[rank] = out.get(rank, 0) + _count(sample.value)
    return out
