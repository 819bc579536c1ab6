"""What the server needs to know about the model beyond its tokenizer: its vocabulary rows.

A model's output layer often has more rows than its tokenizer has ids (padded for the
hardware: the released Qwen3 models have 151,936 rows for a 151,669-id tokenizer), and
a sampler may draw any row. Sampled ids are therefore bounded by the model's
vocabulary, not the tokenizer's: an id in the padding is committed exactly, and the
session notes that its tokenizer cannot decode it. The rows come from, in order, the
`vocab_size` setting, the `config.json` beside the tokenizer (a model directory, or the
hub cache for a hub name), and the tokenizer's own size.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["model_vocab_size", "read_config_vocab_size"]

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
