"""The model-family registry: the one table that says what each chat-template family has.

Every family the server can serve is one frozen `Family` below: which codec serves it,
how detection finds it (the packaged reference template and the exact probe data it
must give, the marker hint tried after the probes, or a detector tried before them),
its tool-call format, which incremental (while-sampling) parser mirrors its parse, and
the offline tokenizer the simulator and tests build for it. Detection (`detect.py`),
the probe checks (`template_checks.py`), `codec_for` (`__init__.py`), the `renderers` codec,
the simulator's tokenizers, the server's incremental parsers and the settings help all
read this table; none keeps a list of its own. The table is checked when this module
is imported (`_validate`): a family added with inconsistent data fails at import, not
on the first request that reaches it.

A name may appear twice: once as ours and once as a `renderers` family (qwen3, kimi-k2,
gemma4). Ours serves the plain name; `renderers:NAME` forces the renderers codec.

This module holds data about the families and never imports `session_server`: the
incremental parser is named by `IncrementalKind`, and the server maps each kind to its
implementation (`session_server/turn/incremental.py`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from trajectory.codec.chatml_qwen3 import Qwen3Codec
from trajectory.codec.deepseek import DeepSeekCodec, is_deepseek_template
from trajectory.codec.gemma4 import Gemma4Codec
from trajectory.codec.generic import GenericCodec
from trajectory.codec.glm4 import Glm4Codec
from trajectory.codec.harmony import HarmonyCodec, is_harmony_template
from trajectory.codec.kimi import KimiCodec, is_kimi_template
from trajectory.codec.llama3 import Llama3Codec
from trajectory.codec.llama31 import Llama31Codec
from trajectory.codec.template import TemplateCodec

__all__ = [
    "FAMILIES", "GENERIC", "LLAMA_SPLIT", "QWEN_SPLIT", "EarlyDetector", "Family", "IncrementalKind",
    "IncrementalParser", "MarkerRule", "ProbeData", "RegistryError", "SimTokenizer", "Source", "ToolCallFormat",
    "early_families", "generic", "incremental_parser", "known_names", "marker_families", "ours", "ours_names",
    "renderer_names", "sim_families", "template_families",
]

GENERIC = "generic"


class RegistryError(ValueError):
    """The family table contradicts itself (raised at import)."""


class Source(enum.StrEnum):
    """Whose code serves the family."""

    OURS = "ours"  # a hand-written codec of this package
    RENDERERS = "renderers"  # the `renderers` library's family of that name, through `RenderersCodec`
    GENERIC = "generic"  # the prober + verifier for a template no family claims


class ToolCallFormat(enum.StrEnum):
    """How a family's sampled text writes a tool call (what its parse reads)."""

    NONE = "none"  # the template renders no tool calls: every reply is content
    HERMES = "hermes"  # <tool_call>{"name": N, "arguments": {...}}</tool_call>
    GLM_XML = "glm_xml"  # <tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
    BARE_JSON = "bare_json"  # no markup: the whole reply is {"name": N, "parameters": {...}} (Llama 3.x)
    GEMMA = "gemma"  # <|tool_call>call:N{k:v}<tool_call|>
    DEEPSEEK = "deepseek"  # DeepSeek's call markers (V3.1 JSON, V3.2/V4 DSML blocks)
    KIMI = "kimi"  # <|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}<|tool_call_end|>
    HARMONY = "harmony"  # to=functions.N <|constrain|>json<|message|>{...}<|call|>
    RENDERER = "renderer"  # the `renderers` family's own parser
    PROBED = "probed"  # the generic codec: what the template's markers name (Hermes, Qwen3-Coder XML or none)


class IncrementalKind(enum.StrEnum):
    """Which incremental parser mirrors the family's parse while tokens are sampled; the
    server holds one implementation per kind. NONE: the text is sent by the whole-parse
    fallback, which is always correct, only later."""

    NONE = "none"
    PLAIN = "plain"  # every sampled character is content
    HERMES = "hermes"  # `<think>` reasoning, then Hermes JSON calls (`parse_hermes`)
    GLM = "glm"  # `<think>` reasoning (whitespace-stripped), then GLM XML calls (`parse_glm`)
    PROBED = "probed"  # the generic codec: HERMES as far as the template's markers go, NONE for XML calls


@dataclass(frozen=True)
class ProbeData:
    """What the family's template must probe to, as text (decoded, specials kept): a
    look-alike template that behaves differently is refused, not served on wrong
    assumptions (`registry.validate_probe`)."""

    eot: str  # "" when the family has no end-of-turn token
    gap: str
    generation_prompt: str
    boundary: tuple[str, ...] = ()  # role tokens that close a turn (no-EOT families)


@dataclass(frozen=True)
class MarkerRule:
    """The hint tried when no probe candidate matches: every string of `all_of` is in the
    template. Rules are tried by `rank`, lowest first (the more specific first: Llama
    3.1's `"parameters"` before plain Llama 3); the probe data must then agree."""

    all_of: tuple[str, ...]
    rank: int


@dataclass(frozen=True)
class EarlyDetector:
    """How a family without one reference template (several template versions) is found
    before the probe candidates. `matches` reads the tokenizer; with `confirm_by_building`
    the family's codec must also build for it (else the probe candidates decide)."""

    matches: Callable[[Any], bool]
    reason: str  # the Detection's reason
    rank: int  # tried lowest first
    confirm_by_building: bool = False


# the real tokenizers' pre-tokenizer split (tokenizer.json): newline runs are one piece, so a
# prompt ending in "\n\n" tokenizes the same alone as in front of the reply
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class SimTokenizer:
    """The offline tokenizer the simulator and tests build for the family
    (`session_server/sim/tokenizers.py`): the real family's special tokens on a small
    BPE, carrying the family's packaged template."""

    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    prepend_bos: bool  # real Llama tokenizers add BOS on encode(add_special_tokens=True)
    split_pattern: str


@dataclass(frozen=True)
class Family:
    """One family: the registry's row (module doc)."""

    name: str
    source: Source
    tool_calls: ToolCallFormat
    # OURS and GENERIC: the codec class, built as codec(tokenizer, probe) (GENERIC: codec(tokenizer));
    # RENDERERS: None, served by RenderersCodec(tokenizer, name)
    codec: type[TemplateCodec] | None = None
    incremental: IncrementalKind = IncrementalKind.NONE
    template_file: str | None = None  # packaged reference template: a digest match and a probe candidate
    probe: ProbeData | None = None  # with template_file
    markers: MarkerRule | None = None
    early: EarlyDetector | None = None
    sim: SimTokenizer | None = None


_QWEN3_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>",
)
_LLAMA_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
)
# GLM's real tokenizer also has <|endoftext|> (its EOS / pad); the template never emits it.
_GLM_TOKENS = (
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
    "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<tool_response>", "</tool_response>",
)
_LLAMA_SIM = SimTokenizer(_LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", True, LLAMA_SPLIT)
_LLAMA_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _chat_template(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "chat_template", "") or "")


def _renderer(name: str, tool_calls: ToolCallFormat = ToolCallFormat.RENDERER) -> Family:
    return Family(name, Source.RENDERERS, tool_calls)


# The order is meaningful: our families with a reference template are probe candidates in
# this order (ties go to the earlier), then the renderers families in theirs; `known_names`
# lists every name in this order.
FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen3", Source.OURS, ToolCallFormat.HERMES, Qwen3Codec, IncrementalKind.HERMES,
        template_file="qwen3.jinja",
        probe=ProbeData("<|im_end|>", "\n", "<|im_start|>assistant\n"),
        markers=MarkerRule(("<|im_start|>", "<think>", "<tool_call>"), rank=3),
        sim=SimTokenizer(_QWEN3_TOKENS, None, "<|im_end|>", "<|endoftext|>", False, QWEN_SPLIT),
    ),
    Family(
        "llama3", Source.OURS, ToolCallFormat.NONE, Llama3Codec,
        template_file="llama3.jinja",
        probe=ProbeData("<|eot_id|>", "", _LLAMA_PROMPT),
        markers=MarkerRule(("<|start_header_id|>", "<|eot_id|>"), rank=2),
        sim=_LLAMA_SIM,
    ),
    Family(
        "llama3.1", Source.OURS, ToolCallFormat.BARE_JSON, Llama31Codec,
        template_file="llama3.1_json_tools.jinja",
        probe=ProbeData("<|eot_id|>", "", _LLAMA_PROMPT),
        markers=MarkerRule(("<|start_header_id|>", "<|eot_id|>", '"parameters"'), rank=1),
        sim=_LLAMA_SIM,
    ),
    Family(
        "glm4moe", Source.OURS, ToolCallFormat.GLM_XML, Glm4Codec, IncrementalKind.GLM,
        template_file="glm4moe.jinja",
        probe=ProbeData("", "", "<|assistant|>", ("<|user|>", "<|observation|>")),
        markers=MarkerRule(("[gMASK]", "<arg_key>"), rank=0),
        sim=SimTokenizer(_GLM_TOKENS, None, "<|endoftext|>", "<|endoftext|>", False, QWEN_SPLIT),
    ),
    Family(
        "gemma4", Source.OURS, ToolCallFormat.GEMMA, Gemma4Codec,
        template_file="gemma4.jinja",
        # thinking off (the template's default): an empty thought channel is prefilled
        probe=ProbeData("<turn|>", "\n", "<|turn>model\n<|channel>thought\n<channel|>"),
        markers=MarkerRule(("<|turn>", "<|channel>", "<|tool_call>"), rank=4),
    ),
    Family(
        # V3.1, V3.2 and V4 templates differ (no one reference to compare probes with), and
        # renderers' deepseek-v3/v4 serve none of them
        "deepseek", Source.OURS, ToolCallFormat.DEEPSEEK, DeepSeekCodec,
        early=EarlyDetector(
            lambda tok: is_deepseek_template(_chat_template(tok)),
            "DeepSeek turn and tool-call markers; its prefill-aware codec plays the template token for token "
            "with thinking on and off",
            rank=1, confirm_by_building=True,
        ),
    ),
    # the `renderers` (0.1.12) text families we serve; its VL/multimodal-only ones and its
    # DefaultRenderer are left out (the latter never bridges: our generic prober does)
    _renderer("qwen3"),
    _renderer("prime-qwen3"),
    _renderer("qwen3.5"),
    _renderer("qwen3.6"),
    _renderer("qwen3.8"),
    _renderer("glm-4.5"),
    _renderer("glm-5"),
    _renderer("glm-5.1"),
    _renderer("glm-5.3"),
    _renderer("minimax-m2"),
    _renderer("deepseek-v3"),
    _renderer("deepseek-r1"),
    _renderer("deepseek-v4"),
    _renderer("kimi-k2"),
    _renderer("kimi-k2.5"),
    _renderer("nemotron-3"),
    _renderer("nemotron-3.5"),
    # no tool-call markup: the exactly decoded reply is parsed by our Llama 3.1 grammar
    _renderer("llama-3", ToolCallFormat.BARE_JSON),
    _renderer("gpt-oss"),
    _renderer("gemma4"),
    _renderer("hy3"),
    _renderer("laguna-xs.2"),
    _renderer("laguna-xs-2.1"),
    _renderer("laguna-s-2.1"),
    Family(
        # every template version (renderers' kimi-k2 refuses them at load); the codec
        # refuses, with the reason, one it cannot render
        "kimi-k2", Source.OURS, ToolCallFormat.KIMI, KimiCodec,
        early=EarlyDetector(
            lambda tok: is_kimi_template(_chat_template(tok)),
            "the template carries kimi-k2's role and tool-call tokens",
            rank=2,
        ),
    ),
    Family(
        # gpt-oss: renderers' gpt-oss renderer needs openai-harmony's vocabulary download and
        # renders unlike the template
        "harmony", Source.OURS, ToolCallFormat.HARMONY, HarmonyCodec,
        early=EarlyDetector(
            is_harmony_template,
            "the template speaks harmony (<|start|>/<|channel|>/<|message|>, stops <|return|>/<|call|>, "
            "generation prompt <|start|>assistant)",
            rank=0,
        ),
    ),
    Family(GENERIC, Source.GENERIC, ToolCallFormat.PROBED, GenericCodec, IncrementalKind.PROBED),
)


@dataclass(frozen=True)
class IncrementalParser:
    """The incremental parser of one codec: its kind (never PROBED), and whether the parse
    splits reasoning and reads tool calls at all (the generic codec: only where its
    template carries the markers)."""

    kind: IncrementalKind
    reasoning: bool = True
    tool_calls: bool = True


_NO_PARSER = IncrementalParser(IncrementalKind.NONE, False, False)


def incremental_parser(codec: Any) -> IncrementalParser:
    """The incremental parser the registry declares for `codec`'s class (exactly that
    class: a subclass may parse otherwise). A class the registry does not list gets
    NONE (the whole-parse fallback), but for the base `TemplateCodec`, whose parse keeps
    every character as content (PLAIN)."""
    kind = type(codec)
    if kind is TemplateCodec:
        return IncrementalParser(IncrementalKind.PLAIN, False, False)
    family = _BY_CODEC.get(kind)
    if family is None or family.incremental is IncrementalKind.NONE:
        return _NO_PARSER
    if family.incremental is IncrementalKind.PROBED:
        if codec.xml_calls:
            return _NO_PARSER
        return IncrementalParser(IncrementalKind.HERMES, codec.reasoning_markers, codec.hermes_calls)
    return IncrementalParser(family.incremental)


def ours(name: str) -> Family | None:
    """Our (hand-written) family of that name, or None."""
    return _OURS.get(name)


def generic() -> Family:
    """The generic family (prober + verifier)."""
    return _OURS[GENERIC]


def ours_names() -> tuple[str, ...]:
    """Names our own codecs serve (the generic one included)."""
    return tuple(_OURS)


def template_families() -> tuple[Family, ...]:
    """Ours with a packaged reference template, in probe-candidate order."""
    return tuple(f for f in FAMILIES if f.template_file is not None)


def renderer_names() -> tuple[str, ...]:
    """The `renderers` families we serve, in probe-candidate order."""
    return tuple(f.name for f in FAMILIES if f.source is Source.RENDERERS)


def renderers_with(tool_calls: ToolCallFormat) -> frozenset[str]:
    """The `renderers` families whose calls are written in `tool_calls`."""
    return frozenset(f.name for f in FAMILIES if f.source is Source.RENDERERS and f.tool_calls is tool_calls)


def ours_with(tool_calls: ToolCallFormat) -> frozenset[str]:
    """Our families whose calls are written in `tool_calls`."""
    return frozenset(f.name for f in FAMILIES if f.source is Source.OURS and f.tool_calls is tool_calls)


def marker_families() -> tuple[Family, ...]:
    """Ours with a marker hint, in the order the hints are tried."""
    return tuple(sorted((f for f in FAMILIES if f.markers is not None), key=lambda f: _rank(f.markers)))


def early_families() -> tuple[Family, ...]:
    """Ours found before the probe candidates, in the order they are tried."""
    return tuple(sorted((f for f in FAMILIES if f.early is not None), key=lambda f: _rank(f.early)))


def sim_families() -> tuple[str, ...]:
    """Families the simulator builds an offline tokenizer for."""
    return tuple(f.name for f in FAMILIES if f.sim is not None)


def known_names() -> tuple[str, ...]:
    """Every family name a caller may force, in table order (a name ours and renderers
    share is listed once)."""
    return tuple(dict.fromkeys(f.name for f in FAMILIES))


def _rank(rule: MarkerRule | EarlyDetector | None) -> int:
    assert rule is not None
    return rule.rank


def _validate(families: tuple[Family, ...]) -> None:
    """Refuse a table that contradicts itself (module doc)."""
    seen: set[tuple[str, Source]] = set()
    templates = resources.files("trajectory.codec").joinpath("templates")
    for f in families:
        where = f"family {f.name!r} ({f.source})"
        key = (f.name, Source.OURS if f.source is Source.GENERIC else f.source)
        if key in seen:
            raise RegistryError(f"{where} is listed twice")
        seen.add(key)
        if f.source is Source.RENDERERS:
            if f.codec is not None or f.incremental is not IncrementalKind.NONE:
                raise RegistryError(f"{where}: served by RenderersCodec, which has no incremental parser")
            if any(x is not None for x in (f.template_file, f.probe, f.markers, f.early, f.sim)):
                raise RegistryError(f"{where}: renderers families are found by their probes alone")
            continue
        if f.codec is None or getattr(f.codec, "family", None) != f.name:
            raise RegistryError(f"{where}: needs a codec class whose `family` is {f.name!r}")
        if (f.source is Source.GENERIC) != (f.name == GENERIC):
            raise RegistryError(f"{where}: only {GENERIC!r} is the generic family")
        if (f.incremental is IncrementalKind.PROBED) != (f.source is Source.GENERIC):
            raise RegistryError(f"{where}: only the generic codec's parser is decided by its probe")
        if (f.template_file is None) != (f.probe is None):
            raise RegistryError(f"{where}: a reference template comes with the probe data it gives")
        if f.template_file is not None and not templates.joinpath(f.template_file).is_file():
            raise RegistryError(f"{where}: no packaged template {f.template_file!r}")
        if f.markers is not None and f.probe is None:
            raise RegistryError(f"{where}: a marker hint is trusted only with probe data to check")
        if f.sim is not None and f.template_file is None:
            raise RegistryError(f"{where}: a simulator tokenizer carries the packaged template")
    for rules in ([f.markers for f in families if f.markers], [f.early for f in families if f.early]):
        ranks = [r.rank for r in rules]
        if len(set(ranks)) != len(ranks):
            raise RegistryError(f"two detection rules share a rank: {sorted(ranks)}")
    if sum(f.source is Source.GENERIC for f in families) != 1:
        raise RegistryError(f"exactly one {GENERIC!r} family")


_validate(FAMILIES)
_OURS: dict[str, Family] = {f.name: f for f in FAMILIES if f.source is not Source.RENDERERS}
_BY_CODEC: dict[type, Family] = {f.codec: f for f in FAMILIES if f.codec is not None}
