"""The chat-template codec (TITO): load one per tokenizer with `load_codec`.

Owns the package's public surface: the contract types from `base`, the family
codecs and `load_codec`, which detects the family from the template alone
(`detect.py`: probe renders compared with each candidate), then builds the codec
the family registry (`families.py`) names for it: one of ours (its probe validated
against the family's exact data), a `renderers`-backed one, or, for an unknown
template, the generic prober + verifier (which refuses what it cannot verify).
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
from trajectory.codec.deepseek import DeepSeekCodec
from trajectory.codec.detect import (
    RENDERERS_PREFIX,
    Detection,
    detect_family,
    known_families,
    resolve_family,
)
from trajectory.codec.families import Source, ours, renderer_names
from trajectory.codec.gemma4 import Gemma4Codec
from trajectory.codec.generic import GenericCodec
from trajectory.codec.glm4 import Glm4Codec
from trajectory.codec.harmony import HarmonyCodec
from trajectory.codec.kimi import KimiCodec
from trajectory.codec.llama3 import Llama3Codec
from trajectory.codec.llama31 import Llama31Codec
from trajectory.codec.probe import decode_text, probe_template
from trajectory.codec.renderers_codec import RenderersCodec
from trajectory.codec.template import TemplateCodec
from trajectory.codec.template_checks import validate_probe
from trajectory.errors import TemplateNotSupported

__all__ = [
    "BridgeRefusal",
    "BridgeResult",
    "ChatCodec",
    "DeepSeekCodec",
    "Detection",
    "Gemma4Codec",
    "GenericCodec",
    "Glm4Codec",
    "HarmonyCodec",
    "HistoryPolicy",
    "KimiCodec",
    "Llama31Codec",
    "Llama3Codec",
    "Message",
    "ParsedAssistant",
    "ParsedToolCall",
    "Qwen3Codec",
    "RefusalReason",
    "RenderersCodec",
    "TemplateCodec",
    "ToolCallParseStatus",
    "codec_for",
    "decode_text",
    "detect_family",
    "known_families",
    "load_codec",
    "resolve_family",
]

def load_codec(tokenizer_or_path: Any, *, family: str | None = None) -> ChatCodec:
    """A codec for a tokenizer object or a path/name (`AutoTokenizer.from_pretrained`).

    `family=None` detects it from the template (`detect_family`); a name forces it:
    one of ours (still validated), a `renderers` family (e.g. "qwen3.5", "glm-5"), or
    "generic" (probe + verify). An unknown name raises `TemplateNotSupported` listing
    the known ones."""
    tokenizer = tokenizer_or_path
    if isinstance(tokenizer_or_path, (str, PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_or_path))
    return codec_for(tokenizer, resolve_family(tokenizer, family))


def codec_for(tokenizer: Any, detection: Detection) -> ChatCodec:
    """The codec of an already resolved family (`resolve_family`), as the registry says."""
    fam = detection.family
    if fam.startswith(RENDERERS_PREFIX):
        return RenderersCodec(tokenizer, fam.removeprefix(RENDERERS_PREFIX))
    spec = ours(fam)
    if spec is None:
        if fam in renderer_names():
            return RenderersCodec(tokenizer, fam)
        raise TemplateNotSupported(f"unknown codec family {fam!r}; known: {', '.join(known_families())}")
    assert spec.codec is not None
    if spec.source is Source.GENERIC:
        return spec.codec(tokenizer)
    probe = probe_template(tokenizer)
    if spec.probe is not None:
        validate_probe(fam, tokenizer, probe)
    return spec.codec(tokenizer, probe)
