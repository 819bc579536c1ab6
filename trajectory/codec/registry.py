"""Family detection and the exact data each known family must probe to.

Owns what identifies our hand-written families: the exact (sha256) text of the
packaged public templates and unambiguous markers in a template (used by
`detect.detect_family`, which decides).
For every known family the probed EOT, gap and generation prompt are checked
against the exact strings below, so a look-alike template that behaves
differently is refused instead of being handled with the wrong assumptions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from trajectory.codec.probe import ProbeResult, decode_text
from trajectory.errors import TemplateNotSupported


@dataclass(frozen=True)
class FamilyData:
    """What a family's template must produce, as text (decoded, specials kept)."""

    template_file: str
    eot: str  # "" when the family has no end-of-turn token
    gap: str
    generation_prompt: str
    boundary: tuple[str, ...]  # role tokens that close a turn (no-EOT families)


FAMILY_DATA: dict[str, FamilyData] = {
    "qwen3": FamilyData("qwen3.jinja", "<|im_end|>", "\n", "<|im_start|>assistant\n", ()),
    "llama3": FamilyData(
        "llama3.jinja", "<|eot_id|>", "", "<|start_header_id|>assistant<|end_header_id|>\n\n", ()
    ),
    "llama3.1": FamilyData(
        "llama3.1_json_tools.jinja",
        "<|eot_id|>",
        "",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        (),
    ),
    "glm4moe": FamilyData(
        "glm4moe.jinja", "", "", "<|assistant|>", ("<|user|>", "<|observation|>")
    ),
    # thinking off (the template's default): an empty thought channel is prefilled
    "gemma4": FamilyData(
        "gemma4.jinja", "<turn|>", "\n", "<|turn>model\n<|channel>thought\n<channel|>", ()
    ),
}


def _digest(text: str) -> str:
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()


def _known_digests() -> dict[str, str]:
    out = {}
    root = resources.files("trajectory.codec").joinpath("templates")
    for family, data in FAMILY_DATA.items():
        try:
            out[_digest(root.joinpath(data.template_file).read_text(encoding="utf-8"))] = family
        except FileNotFoundError:
            continue
    return out


def match_digest(template: str) -> str | None:
    """Our family whose packaged template is exactly `template` (sha256), or None."""
    return _known_digests().get(_digest(template))


def match_markers(template: str) -> str | None:
    """Our family whose unambiguous markers `template` carries, or None (a hint only:
    `detect.detect_family` validates the probe before trusting it)."""
    if "[gMASK]" in template and "<arg_key>" in template:
        return "glm4moe"
    if "<|start_header_id|>" in template and "<|eot_id|>" in template:
        return "llama3.1" if '"parameters"' in template else "llama3"
    if "<|im_start|>" in template and "<think>" in template and "<tool_call>" in template:
        return "qwen3"
    if "<|turn>" in template and "<|channel>" in template and "<|tool_call>" in template:
        return "gemma4"
    return None


# families of ours that no packaged template pins (several template versions), found by
# their markers alone and served by the codec of that name (which verifies the template)
MARKER_FAMILIES: tuple[str, ...] = ("kimi-k2",)


def match_marker_family(template: str) -> str | None:
    """Our marker-only family `template` belongs to (Kimi's role and tool-call section
    tokens), or None. Its codec refuses, at load, a template it cannot serve."""
    from trajectory.codec.kimi import is_kimi_template

    return "kimi-k2" if is_kimi_template(template) else None


def validate_probe(family: str, tokenizer: Any, probe: ProbeResult) -> None:
    """Raise `TemplateNotSupported` unless the probe matches the family's exact data."""
    data = FAMILY_DATA[family]

    def text(ids: tuple[int, ...]) -> str:
        return decode_text(tokenizer, ids)

    got = {
        "eot": text(probe.eot_ids),
        "gap": text(probe.gap_ids),
        "generation_prompt": text(probe.generation_prompt_ids),
        "boundary": tuple(text((b,)) for b in probe.boundary_ids),
    }
    want = {
        "eot": data.eot,
        "gap": data.gap,
        "generation_prompt": data.generation_prompt,
        "boundary": data.boundary,
    }
    for key, value in want.items():
        if got[key] != value:
            raise TemplateNotSupported(f"{family}: probed {key} {got[key]!r}, expected {value!r}")
