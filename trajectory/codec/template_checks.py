"""Checks of a template against the exact data of our families (`families.FAMILIES`).

Owns what identifies our hand-written families in a template: the exact (sha256) text
of their packaged public templates, their marker hints (used by `detect.detect_family`,
which decides), and the probe check: for every family with probe data the probed EOT,
gap and generation prompt must equal its exact strings, so a look-alike template that
behaves differently is refused instead of being handled with the wrong assumptions.
The data itself lives in the family registry (`families.py`).
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from trajectory.codec.families import marker_families, ours, template_families
from trajectory.codec.probe import ProbeResult, decode_text
from trajectory.errors import TemplateNotSupported


def _digest(text: str) -> str:
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()


def reference_template(family: str) -> str | None:
    """The packaged reference template of our `family`, or None when it has none."""
    spec = ours(family)
    if spec is None or spec.template_file is None:
        return None
    try:
        return resources.files("trajectory.codec").joinpath("templates", spec.template_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def _known_digests() -> dict[str, str]:
    out = {}
    for spec in template_families():
        text = reference_template(spec.name)
        if text is not None:
            out[_digest(text)] = spec.name
    return out


def match_digest(template: str) -> str | None:
    """Our family whose packaged template is exactly `template` (sha256), or None."""
    return _known_digests().get(_digest(template))


def match_markers(template: str) -> str | None:
    """Our family whose marker hint `template` carries, or None (a hint only:
    `detect.detect_family` validates the probe before trusting it)."""
    for spec in marker_families():
        assert spec.markers is not None
        if all(m in template for m in spec.markers.all_of):
            return spec.name
    return None


def validate_probe(family: str, tokenizer: Any, probe: ProbeResult) -> None:
    """Raise `TemplateNotSupported` unless the probe matches the family's exact data."""
    spec = ours(family)
    if spec is None or spec.probe is None:
        raise KeyError(family)
    data = spec.probe

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
