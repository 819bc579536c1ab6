"""The codec family is detected from the tokenizer's own template, never its name.

Every offline tokenizer (our four families, the renderers families, the real Qwen3 and
DeepSeek tokenizers, unknown templates) is detected, also when its directory is a path
that says nothing about the model. A renderers family whose renderer is known not to
reproduce its template (test_renderers_codec.REFUSED) is not detected (its
fallback is pinned below); when that mismatch is fixed and removed from
REFUSED, this test expects the renderer instead.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from session_server.sim.tokenizers import FAMILIES, build_template_tokenizer
from tests.fast.real_tokenizers import real_tokenizer_dir
from tests.fast.trajectory.renderer_families import _NAMED, BY_NAME, RENDERER_FAMILIES, TEMPLATES
from tests.fast.trajectory.test_renderers_codec import REFUSED
from trajectory.codec import (
    GenericCodec,
    RenderersCodec,
    detect_family,
    known_families,
    load_codec,
    resolve_family,
)
from trajectory.codec.detect import PROBES
from trajectory.errors import TemplateNotSupported

# renderers families whose template one of ours also reproduces on every probe: ours
# wins the tie (it passes the contract suite under both policies, as today)
OURS_FIRST = {"qwen3-r": "qwen3", "glm-4.6": "glm4moe"}
# what serves a family whose renderer does not reproduce its template (REFUSED)
FALLBACK = {"llama-3.2": ("llama3.1", "markers"),
            **{n: ("kimi-k2", "markers") for n in BY_NAME if n.startswith("kimi-k2")},
            **{n: ("deepseek", "markers") for n in ("deepseek-v3.1", "deepseek-v3.2", "deepseek-v4-flash")}}
# detected, and refused at load by their codec with the reason (Kimi: the
# template mutates a list, which transformers' immutable sandbox forbids)
REFUSED_AT_LOAD = {"kimi-k2-instruct": "ImmutableSandboxedEnvironment",
                   "kimi-k2-thinking": "ImmutableSandboxedEnvironment"}
# families one of ours packages the template of (test_renderers_codec.OURS)
PACKAGED = {"gemma-4": ("gemma4", "digest")}


def _expected(name: str) -> tuple[str, str]:
    if name in PACKAGED:
        return PACKAGED[name]
    if name in OURS_FIRST:
        return OURS_FIRST[name], "probes"
    if name in REFUSED:
        return FALLBACK.get(name, ("generic", "generic"))
    return BY_NAME[name].renderer, "probes"


def _anonymous(path: Path, tmp_path: Path) -> Any:
    """The tokenizer saved under a name that says nothing (a fine-tune's output dir)."""
    dest = tmp_path / "my-finetune"
    shutil.copytree(path, dest)
    tok = AutoTokenizer.from_pretrained(str(dest))
    assert tok.name_or_path.endswith("my-finetune")
    return tok


@pytest.mark.parametrize("family", FAMILIES)
def test_our_families_detected_under_an_anonymous_path(
    tokenizer_dirs: dict[str, Path], family: str, tmp_path: Path
) -> None:
    det = detect_family(_anonymous(tokenizer_dirs[family], tmp_path))
    assert (det.family, det.source) == (family, "digest"), det


@pytest.fixture(scope="module")
def renderer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.fast.trajectory.renderer_families import build

    root = tmp_path_factory.mktemp("detect-renderers")
    return {f.name: build(f, root / f.name.replace(".", "_")) for f in RENDERER_FAMILIES}


@pytest.mark.parametrize("name", [f.name for f in RENDERER_FAMILIES])
def test_renderer_families_detected_under_an_anonymous_path(
    renderer_dirs: dict[str, Path], name: str, tmp_path: Path
) -> None:
    tok = _anonymous(renderer_dirs[name], tmp_path)
    det = detect_family(tok)
    assert (det.family, det.source) == _expected(name), det.describe()
    if det.family == "generic":  # the prober serves a template it verifies, else refuses clearly
        try:
            load_codec(tok)
        except TemplateNotSupported as exc:
            assert str(exc)
        return
    if name in REFUSED_AT_LOAD:
        with pytest.raises(TemplateNotSupported, match=REFUSED_AT_LOAD[name]):
            load_codec(tok)
        return
    codec = load_codec(tok)  # detection is what load_codec serves
    assert codec.family == det.family
    if det.source == "probes" and det.family not in OURS_FIRST.values():
        assert isinstance(codec, RenderersCodec)


def test_a_tie_goes_to_our_family(load_renderer_tokenizer: Callable[[str], Any]) -> None:
    """Qwen3's public template: our qwen3 and renderers' qwen3 both reproduce every
    probe; ours is first in the preference order, and renderers:qwen3 forces theirs."""
    tok = load_renderer_tokenizer("qwen3-r")
    assert detect_family(tok).family == "qwen3"
    theirs = load_codec(tok, family="renderers:qwen3")
    assert isinstance(theirs, RenderersCodec)
    for probe in PROBES:
        msgs, tools = list(probe.messages), list(probe.tools) or None
        own = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.decode(theirs.render_first(msgs, tools=tools)) == own, probe.name


def test_reason_names_probes_and_closest_candidates(load_renderer_tokenizer: Callable[[str], Any]) -> None:
    det = detect_family(load_renderer_tokenizer("glm-4.7"))
    assert det.source == "probes" and "12/12 probes" in det.reason and "tool-call+result" in det.reason
    # Qwen3-Coder: no family of ours and its renderer (qwen3.5) refused: the generic prober
    det = detect_family(load_renderer_tokenizer("qwen3-coder"))
    assert det.family == "generic" and "no candidate renders every probe" in det.reason, det.describe()
    assert "cannot be built for this tokenizer" in det.reason


@pytest.mark.parametrize(("name", "family"), [("qwen3.5", "qwen3.5"), ("glm-4.7", "glm-5"), ("glm-4.6", "glm-4.5"),
                                              ("qwen3-r", "generic")])
def test_a_forced_family_wins_over_detection(load_renderer_tokenizer: Callable[[str], Any], name: str, family: str) -> None:
    tok = load_renderer_tokenizer(name)
    det = resolve_family(tok, family)
    assert (det.family, det.source) == (family, "forced")
    codec = load_codec(tok, family=family)
    assert codec.family == family
    assert isinstance(codec, GenericCodec if family == "generic" else RenderersCodec)


def test_unknown_family_name_lists_the_known_ones(load_tokenizer: Callable[[str], Any]) -> None:
    with pytest.raises(TemplateNotSupported) as err:
        load_codec(load_tokenizer("qwen3"), family="qwen-9000")
    msg = str(err.value)
    assert "qwen-9000" in msg and all(f in msg for f in ("qwen3", "glm4moe", "qwen3.5", "glm-5", "generic"))
    assert set(known_families()) >= {"qwen3", "llama3", "llama3.1", "glm4moe", "qwen3.5", "glm-5", "generic"}


@pytest.mark.parametrize(("template", "eos"), [
    ("HuggingFaceTB-SmolLM3-3B.jinja", "<|im_end|>"),
    ("ibm-granite-granite-4.0.jinja", "<|end_of_text|>"),
])
def test_unknown_template_falls_back_to_generic(tmp_path: Path, template: str, eos: str) -> None:
    text = (TEMPLATES / template).read_text(encoding="utf-8")
    specials = tuple(dict.fromkeys((eos, *sorted(set(_NAMED.findall(text))))))
    path = build_template_tokenizer(tmp_path / "tok", text, specials, bos=None, eos=eos)
    tok = AutoTokenizer.from_pretrained(str(path))
    det = detect_family(tok)
    assert (det.family, det.source) == ("generic", "generic"), det.describe()
    assert isinstance(load_codec(tok), GenericCodec)  # the prober verified it: it serves


@pytest.mark.parametrize(("name", "family"), [
    ("qwen3-real", "qwen3"), ("deepseek-v3.1-real", "deepseek"), ("deepseek-v4-real", "deepseek"),
    ("deepseek-v3.2-real", "deepseek"),
])
def test_real_tokenizers_are_detected_as_their_family(tmp_path: Path, name: str, family: str) -> None:
    """Qwen3's real template is ours; renderers has no DeepSeek V3.1/V3.2 renderer and its
    deepseek-v4 differs from the real V4 template (tools without a system message, the
    `thinking` kwarg), so DeepSeek's markers pick our `DeepSeekCodec`."""
    tok = _anonymous(real_tokenizer_dir(name, tmp_path / "src"), tmp_path)
    det = detect_family(tok)
    assert det.family == family, det.describe()
    assert load_codec(tok).family == family
