"""What the server needs to know about the model beyond its tokenizer: its vocabulary rows,
and, for routing replay, the shape of its routed experts.

A model's output layer often has more rows than its tokenizer has ids (padded for the
hardware: the released Qwen3 models have 151,936 rows for a 151,669-id tokenizer), and
a sampler may draw any row. Sampled ids are therefore bounded by the model's
vocabulary, not the tokenizer's: an id in the padding is committed exactly, and the
session notes that its tokenizer cannot decode it. The rows come from, in order, the
`vocab_size` setting, the `config.json` beside the tokenizer (a model directory, or the
hub cache for a hub name), and the tokenizer's own size.

SGLang sends routed experts as a flat int32 list whose rows are
``hf_text_config.num_hidden_layers x hf_text_config.num_experts_per_tok`` wide (the
capture buffer of sgl-project/sglang python/sglang/srt/layers/moe/routed_experts_capturer.py);
neither engine reports those numbers on the wire (SGLang `/get_model_info` and
`/server_info`, vLLM `/v1/models`: tests/fixtures/engines/), but both name the model
they serve (`model_path`; vLLM's `root`), so the server reads them from that model's
`config.json` when it can see it (`model_routed_shape`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["model_routed_shape", "model_vocab_size", "read_config_routed_shape", "read_config_vocab_size"]

log = logging.getLogger(__name__)


def read_config_vocab_size(config: dict[str, Any]) -> int | None:
    """`vocab_size` of a transformers `config.json` (top level, or its `text_config` for
    multimodal models); None when absent or not a positive int."""
    for source in (config, config.get("text_config")):
        if isinstance(source, dict):
            v = source.get("vocab_size")
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _positive(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# the expert count's key differs by family: Qwen-MoE `num_experts`, DeepSeek
# `n_routed_experts`, Mixtral `num_local_experts`
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def read_config_routed_shape(config: dict[str, Any]) -> tuple[int, int, int | None] | None:
    """(layers, topk, experts per layer or None) of a MoE `config.json`, read where SGLang
    reads them: its text config (`text_config` of a multimodal model, else the top level),
    `num_hidden_layers` and `num_experts_per_tok`. None for a dense model (no
    `num_experts_per_tok`) or a config without them."""
    text = config.get("text_config")
    source = text if isinstance(text, dict) else config
    layers, topk = _positive(source.get("num_hidden_layers")), _positive(source.get("num_experts_per_tok"))
    if layers is None or topk is None:
        return None
    experts = next((n for k in _EXPERT_COUNT_KEYS if (n := _positive(source.get(k))) is not None), None)
    return layers, topk, experts


def model_routed_shape(name_or_path: str) -> tuple[int, int, int | None] | None:
    """`read_config_routed_shape` of the `config.json` of a model directory, or of a hub
    name already in the local cache (never a download); None when there is none to read.
    Blocking file I/O: call it off the event loop."""
    path = _config_path(name_or_path)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot read the model's routed-experts shape from %s: %s", path, exc)
        return None
    return read_config_routed_shape(config) if isinstance(config, dict) else None


def _config_path(name_or_path: str) -> Path | None:
    if not name_or_path:
        return None
    local = Path(name_or_path) / "config.json"
    if local.is_file():
        return local
    if Path(name_or_path).exists():
        return None
    try:  # a hub name: only what is already in the local cache, never a download
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
    except Exception:  # an invalid repo id, or no huggingface_hub: nothing cached to read
        return None
    return Path(cached) if isinstance(cached, str) else None


def model_vocab_size(tokenizer: Any, override: int | None = None) -> int:
    """The bound on sampled ids: `override`, else the model config's rows, never fewer
    than the tokenizer's ids (a config smaller than its tokenizer is ignored, with a
    warning: ids the tokenizer emits must stay valid)."""
    tokenizer_size = len(tokenizer)
    rows: int | None = override
    if rows is None:
        path = _config_path(str(getattr(tokenizer, "name_or_path", "") or ""))
        if path is not None:
            try:
                rows = read_config_vocab_size(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("cannot read the model's vocab_size from %s: %s", path, exc)
        if rows is None:
            return tokenizer_size
    if rows < tokenizer_size:
        log.warning("vocab_size %d is smaller than the tokenizer's %d ids; using %d",
                    rows, tokenizer_size, tokenizer_size)
        return tokenizer_size
    return rows
