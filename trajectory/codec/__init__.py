"""The chat-template codec (TITO): load one per tokenizer with `load_codec`.

Owns the package's public surface: the contract types from `base`, the family
codecs and `load_codec`, which detects the family, probes the template and
validates the probe against the family's exact data (or, for an unknown
template, probes and verifies it generically, else refuses).
"""

from __future__ import annotations

from os import PathLike
from typing import Any

from trajectory.codec.base import (
    BridgeRefusal,
    BridgeResult,
    ChatCodec,
    HistoryPolicy,
    Message,
    ParsedAssistant,
    ParsedToolCall,
    RefusalReason,
    ToolCallParseStatus,
)
from trajectory.codec.chatml_qwen3 import Qwen3Codec
from trajectory.codec.generic import GenericCodec
from trajectory.codec.glm4 import Glm4Codec
from trajectory.codec.llama3 import Llama3Codec
from trajectory.codec.llama31 import Llama31Codec
from trajectory.codec.probe import decode_text, probe_template
from trajectory.codec.registry import FAMILY_DATA, detect_family, validate_probe
from trajectory.codec.template import TemplateCodec
from trajectory.errors import TemplateNotSupported

__all__ = [
    "BridgeRefusal",
    "BridgeResult",
    "ChatCodec",
    "GenericCodec",
    "Glm4Codec",
    "HistoryPolicy",
    "Llama31Codec",
    "Llama3Codec",
    "Message",
    "ParsedAssistant",
    "ParsedToolCall",
    "Qwen3Codec",
    "RefusalReason",
    "TemplateCodec",
    "ToolCallParseStatus",
    "decode_text",
    "detect_family",
    "load_codec",
]

_CODECS: dict[str, type[TemplateCodec]] = {
    "qwen3": Qwen3Codec,
    "llama3": Llama3Codec,
    "llama3.1": Llama31Codec,
    "glm4moe": Glm4Codec,
}


def load_codec(tokenizer_or_path: Any, *, family: str | None = None) -> ChatCodec:
    """A codec for a tokenizer object or a path/name (`AutoTokenizer.from_pretrained`).

    `family` forces a known family (still validated); "generic" forces probing."""
    tokenizer = tokenizer_or_path
    if isinstance(tokenizer_or_path, (str, PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_or_path))
    fam = family if family is not None else detect_family(tokenizer)
    if fam is None or fam == "generic":
        return GenericCodec(tokenizer)
    if fam not in _CODECS:
        raise TemplateNotSupported(f"unknown codec family {fam!r}; known: {sorted(_CODECS)}")
    probe = probe_template(tokenizer)
    if fam in FAMILY_DATA:
        validate_probe(fam, tokenizer, probe)
    return _CODECS[fam](tokenizer, probe)
