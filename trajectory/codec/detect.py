"""Which codec family serves a tokenizer, decided from its chat template alone.

Owns family detection that never looks at the model's name (`name_or_path`):
`renderers` matches names exactly, which fails for local paths and fine-tunes.
Instead the tokenizer's own template renders a few probe conversations
(`apply_chat_template(..., tokenize=False)`) and each candidate renders the same
probes; a candidate whose text equals the template's on every probe matches.
Probes: system+user, user+assistant+user, the same with reasoning in the history,
a tool call + its result (with tools); each also with every thinking knob
(`enable_thinking`, `thinking`) on and off when the template reacts to it. The
best candidate must reproduce every probe rendered without kwargs; among those,
the one reproducing the most knob variants wins (the reason names the variants it
misses: e.g. renderers' qwen3.5 renders an empty think block in earlier turns with
`enable_thinking=False`, the Qwen3.5 template does not).

What each family has (reference template, probe data, markers, early detector) is
the family registry's (`families.FAMILIES`); this module only applies it, in order:

1. an exact (sha256) copy of one of our packaged templates is that family
   (`source="digest"`);
2. our families without one reference template (`families.early_families`: gpt-oss's
   harmony, DeepSeek V3.1/V3.2/V4, Kimi K2, several template versions each) are found
   by their markers (`source="markers"`); DeepSeek only when its prefill-aware codec
   can be built for the tokenizer (its self-check plays the template with thinking on
   and off), else the candidates below decide;
3. the probe candidates, in the registry's preference order (ties go to the earlier
   one): first our families with a packaged reference template (qwen3, llama3,
   llama3.1, glm4moe, gemma4), each rendering the probes with that template (they pass
   the whole contract suite under both history policies, and render with the
   tokenizer's own template, so choosing them keeps today's codec for these
   templates); then every `renderers` family whose `RenderersCodec` can be constructed
   for this tokenizer (a renderer needs the family's special tokens; a codec that
   cannot be built, e.g. Nemotron 3 today, is no candidate: it could not serve the
   tokenizer anyway). Families of one lineage that render the probes alike
   (qwen3.5/qwen3.6) resolve to the earliest listed;
4. no probe match: the template's marker hint names one of our families and the
   probed end-of-turn, gap and generation prompt equal that family's exact data
   (`template_checks.match_markers` + `validate_probe`, today's behaviour for variants of
   our templates, e.g. Llama 3.2 served by the llama3.1 codec);
5. nothing: `generic`, our prober + verifier (which serves an append-only
   template or refuses it with `TemplateNotSupported`).

A forced family (`resolve_family(tok, "glm-5")`) skips detection; an unknown name is
a `TemplateNotSupported` listing the known ones. Where a renderers name is also one
of ours ("qwen3"), ours serves it; "renderers:qwen3" forces the renderers codec.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trajectory.codec.families import (
    GENERIC,
    early_families,
    known_names,
    renderer_names,
    template_families,
)
from trajectory.codec.probe import decode_text, probe_template, render_form
from trajectory.codec.renderers_codec import RenderersCodec
from trajectory.codec.template_checks import (
    match_digest,
    match_markers,
    reference_template,
    validate_probe,
)
from trajectory.errors import TemplateNotSupported

__all__ = [
    "GENERIC", "OUR_FAMILIES", "RENDERERS_PREFIX", "Detection", "check_family_name", "detect_family",
    "known_families", "resolve_family",
]

log = logging.getLogger(__name__)

# forces the renderers codec for a name ours also has ("renderers:qwen3")
RENDERERS_PREFIX = "renderers:"
# ours with a packaged reference template: the first probe candidates
OUR_FAMILIES: tuple[str, ...] = tuple(f.name for f in template_families())
# template kwargs that switch reasoning on and off, probed both ways when the template reads them
_THINKING_KNOBS = ("enable_thinking", "thinking")

_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@dataclass(frozen=True)
class Probe:
    """One conversation every candidate renders (always with the generation prompt)."""

    name: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] = ()


PROBES: tuple[Probe, ...] = (
    Probe("system+user", (
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    )),
    Probe("user+assistant+user", (
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    )),
    Probe("reasoning+user", (
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "And 3+3?"},
    )),
    Probe("tool-call+result", (
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ), tuple(_TOOLS)),
)


@dataclass(frozen=True)
class Detection:
    """The family chosen for a tokenizer and why (`serve` logs it)."""

    family: str  # one of ours, a renderers name, or "generic"
    source: str  # "forced", "digest", "probes", "markers" or "generic"
    reason: str

    def describe(self) -> str:
        return f"{self.family} ({self.source}: {self.reason})"


def known_families() -> tuple[str, ...]:
    """Every name `resolve_family` / `load_codec(family=...)` accepts (the registry's)."""
    return known_names()


def check_family_name(family: str) -> str:
    """`family` when it names a known family (or "renderers:NAME"), else a
    `TemplateNotSupported` listing the known ones."""
    if family in known_families() or family.removeprefix(RENDERERS_PREFIX) in renderer_names():
        return family
    raise TemplateNotSupported(
        f"unknown template family {family!r}; known: {', '.join(known_families())} "
        f"(or {RENDERERS_PREFIX}NAME for the renderers codec of a name ours also has)"
    )


def resolve_family(tokenizer: Any, family: str | None = None) -> Detection:
    """The forced `family` when given (checked against the known names), else detected."""
    if family is None:
        return detect_family(tokenizer)
    return Detection(check_family_name(family), "forced", "given explicitly (--template-family)")


def probe_variants(tokenizer: Any) -> list[tuple[Probe, dict[str, Any]]]:
    """The probes with no kwargs and, for every thinking knob that changes the
    template's render of some probe (so a template that ignores it is not probed
    with it), with the knob on and off."""
    kwargs: list[dict[str, Any]] = [{}]
    for knob in _THINKING_KNOBS:
        try:
            plain = [_template_render(tokenizer, p, {}) for p in PROBES]
            on = [_template_render(tokenizer, p, {knob: True}) for p in PROBES]
            off = [_template_render(tokenizer, p, {knob: False}) for p in PROBES]
        except Exception:  # the template raises on a probe: _expected reports which
            continue
        if on != plain or off != plain:
            kwargs += [{knob: True}, {knob: False}]
    return [(p, kw) for p in PROBES for kw in kwargs]


def _label(probe: Probe, kw: Mapping[str, Any]) -> str:
    return probe.name + "".join(f" {k}={v}" for k, v in kw.items())


def _template_render(tokenizer: Any, probe: Probe, kw: Mapping[str, Any], chat_template: str | None = None) -> str:
    out = tokenizer.apply_chat_template(
        [render_form(m) for m in probe.messages],
        tools=list(probe.tools) or None,
        add_generation_prompt=True,
        tokenize=False,
        **({"chat_template": chat_template} if chat_template is not None else {}),
        **dict(kw),
    )
    return str(out)


Render = Callable[[Probe, Mapping[str, Any]], str]


@dataclass(frozen=True)
class Score:
    """How a candidate did on the probes."""

    name: str
    hits: int
    misses: tuple[str, ...]  # labels of the probes it did not reproduce
    defaults_ok: bool  # it reproduced every probe rendered without template kwargs


def _score(name: str, render: Render, expected: Sequence[tuple[Probe, dict[str, Any], str]]) -> Score:
    hits, misses, defaults_ok = 0, [], True
    for probe, kw, want in expected:
        try:
            ok = render(probe, kw) == want
        except Exception:  # a candidate that cannot render a probe does not match it
            ok = False
        hits += ok
        if not ok:
            misses.append(_label(probe, kw))
            defaults_ok = defaults_ok and bool(kw)
    return Score(name, hits, tuple(misses), defaults_ok)


def _ours(tokenizer: Any, family: str) -> Render | None:
    ref = reference_template(family)
    if ref is None:
        return None
    return lambda probe, kw: _template_render(tokenizer, probe, kw, ref)


def _renderer(tokenizer: Any, name: str) -> Render | None:
    try:
        codec = RenderersCodec(tokenizer, name)
    except Exception as exc:  # needs tokens this tokenizer lacks, or cannot serve it
        log.debug("renderers %s is no candidate: %s", name, exc)
        return None

    def render(probe: Probe, kw: Mapping[str, Any]) -> str:
        ids = codec.render_first(list(probe.messages), tools=list(probe.tools) or None, template_kwargs=kw or None)
        return decode_text(tokenizer, ids)

    return render


def _expected(tokenizer: Any) -> tuple[list[tuple[Probe, dict[str, Any], str]], list[str]]:
    """The template's own render of every probe it can render, and those it cannot."""
    out, skipped = [], []
    for probe, kw in probe_variants(tokenizer):
        try:
            out.append((probe, kw, _template_render(tokenizer, probe, kw)))
        except Exception:
            skipped.append(_label(probe, kw))
    return out, skipped


def _first_default(score: Score) -> str:
    """The first probe without template kwargs it missed (what disqualified it)."""
    return next((m for m in score.misses if " " not in m), score.misses[0])


def _probe_reason(best: Score, expected: Sequence[tuple[Probe, dict[str, Any], str]], skipped: list[str]) -> str:
    names = ", ".join(sorted({p.name for p, _, _ in expected}))
    reason = f"renders equal the template on {best.hits}/{len(expected)} probes ({names})"
    if best.misses:
        reason += f"; differs only with template kwargs: {', '.join(best.misses)}"
    if skipped:
        reason += f"; the template cannot render {', '.join(skipped)}"
    return reason


def detect_family(tokenizer: Any) -> Detection:
    """The family of the tokenizer's chat template (module doc), never from its name."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return Detection(GENERIC, GENERIC, "the tokenizer has no chat template")
    exact = match_digest(template)
    if exact is not None:
        return Detection(exact, "digest", f"the template is the packaged {exact} template (sha256)")
    for family in early_families():
        assert family.early is not None and family.codec is not None
        if not family.early.matches(tokenizer):
            continue
        if family.early.confirm_by_building:
            try:
                family.codec(tokenizer)
            except Exception as exc:  # not served by this codec: the candidates below decide
                log.debug("%s markers but no %s codec: %s", family.name, family.name, exc)
                continue
        return Detection(family.name, "markers", family.early.reason)
    expected, skipped = _expected(tokenizer)
    if not expected:
        return Detection(GENERIC, GENERIC, "the template renders none of the probes")
    candidates: list[tuple[str, Callable[[Any, str], Render | None]]] = [
        *((f, _ours) for f in OUR_FAMILIES),
        *((n, _renderer) for n in renderer_names()),
    ]
    scores, unbuilt = [], 0
    for name, make in candidates:
        render = make(tokenizer, name)
        if render is None:
            unbuilt += 1
            continue
        scores.append(_score(name, render, expected))
        if scores[-1].hits == len(expected):
            break  # a full match: no later candidate can beat it (preference order)
    total = len(expected)
    eligible = [sc for sc in scores if sc.defaults_ok]
    if eligible:
        best = max(eligible, key=lambda sc: sc.hits)  # max keeps the first of equals
        return Detection(best.name, "probes", _probe_reason(best, expected, skipped))
    ranked = sorted(scores, key=lambda sc: (-sc.hits, sc.name in OUR_FAMILIES))[:3]
    closest = "; ".join(f"{sc.name} {sc.hits}/{total} (first miss: {_first_default(sc)})" for sc in ranked)
    closest = (closest or "none") + f"; {unbuilt} renderers families cannot be built for this tokenizer"
    marked = match_markers(template)
    if marked is not None:
        try:
            validate_probe(marked, tokenizer, probe_template(tokenizer))
        except TemplateNotSupported as exc:
            closest += f"; markers say {marked} but {exc}"
        else:
            return Detection(marked, "markers", f"no candidate renders every probe (closest: {closest}); "
                             f"the template's markers and probed turn tokens are {marked}'s")
    return Detection(GENERIC, GENERIC, f"no candidate renders every probe (closest: {closest})")
