"""`verify_template` checks a chat template against our codec contract:
it passes on our offline families and fails, saying where, on broken templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trajectory.codec import BridgeRefusal, RefusalReason, load_codec
from trajectory.codec.verify import first_difference, verify_template


def fresh(tokenizer_dirs: dict[str, Path], family: str, edit: tuple[str, str] | None = None) -> Any:
    """A private tokenizer of `family` (never the shared cached one), template edited."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dirs[family]))
    if edit is not None:
        old, new = edit
        assert old in tok.chat_template
        tok.chat_template = tok.chat_template.replace(old, new)
    return tok


# the tool result carries its position in the conversation: still append-only, but a
# bridge computed on a short base renders a different index than the full history
BROKEN_BRIDGE = ("'\\n<tool_response>\\n'", "'\\n<tool_response n=' + loop.index0|string + '>\\n'")
# the call is rendered with an `args` key the Hermes parser does not read
BROKEN_PARSE = ('\'", "arguments": \'', '\'", "args": \'')


@pytest.mark.parametrize("family", ["llama3", "llama3.1", "glm4moe"])
def test_verify_passes_on_offline_families(load_tokenizer: Any, family: str) -> None:
    report = verify_template(load_tokenizer(family))
    assert report.ok, report.format_text()
    assert report.family == family
    compared = [s for s in report.steps if s.outcome in ("exact", "mismatch")]
    assert compared and all(s.outcome == "exact" for s in compared)
    assert report.parses and all(p.ok is not False for p in report.parses)


def test_qwen3_every_append_only_step_is_exact(load_tokenizer: Any) -> None:
    report = verify_template(load_tokenizer("qwen3"))
    assert report.ok, report.format_text()
    assert not [s for s in report.steps if s.hard]
    assert all(p.ok for p in report.parses)
    roles = report.roles()
    assert roles["tool"]["exact"] == roles["tool"]["compared"] > 0
    # a client-injected assistant message after the last query: the template gives it an
    # empty `<think></think>` block while it is last, and the bridge now renders it so
    assert roles["assistant"]["exact"] == roles["assistant"]["compared"] > 0
    assert roles["user"]["append_only"] == "no"  # Qwen3 drops earlier reasoning on a user turn
    # every other step is token-exact or a reported (not failed) rewrite
    assert {s.outcome for s in report.steps} <= {"exact", "rewrite"}


def test_verify_template_passes_on_qwen3(load_tokenizer: Any) -> None:
    assert verify_template(load_tokenizer("qwen3")).ok


def test_thinking_modes_follow_the_template_switch(load_tokenizer: Any) -> None:
    assert verify_template(load_tokenizer("qwen3"), thinking="off").thinking_modes == ["off"]
    both = verify_template(load_tokenizer("glm4moe"), thinking="both")
    assert both.thinking_switch and both.thinking_modes == ["on", "off"]
    plain = verify_template(load_tokenizer("llama3"), thinking="on")
    assert not plain.thinking_switch and plain.thinking_modes == ["default"]


def test_broken_bridge_is_a_hard_mismatch_with_the_first_token(tokenizer_dirs: dict[str, Path]) -> None:
    report = verify_template(fresh(tokenizer_dirs, "qwen3", BROKEN_BRIDGE), thinking="on")
    assert not report.ok
    bad = [s for s in report.steps if s.hard]
    assert bad and all(s.outcome == "mismatch" and "tool" in s.roles for s in bad)
    diff = bad[0].difference
    assert diff is not None and "tool_response n=" in diff.expected_context
    assert "tool_response n=" in diff.got_context  # both sides, with different indices
    text = report.format_text()
    assert "[FAIL]" in text and "first differing token at index" in text and "FAILED" in text


def test_broken_parse_is_a_round_trip_failure(tokenizer_dirs: dict[str, Path]) -> None:
    report = verify_template(fresh(tokenizer_dirs, "qwen3", BROKEN_PARSE), thinking="on")
    assert not report.ok
    bad = [p for p in report.parses if p.ok is False]
    assert {p.scenario for p in bad} == {"tool_append_json", "parallel_tool_calls"}
    assert "tool_calls" in bad[0].detail and '"metric": true' in bad[0].detail
    assert any("parse tool_append_json" in f for f in report.hard_failures)


class _RefusingCodec:
    """A codec that refuses every bridge (as a library that cannot prove a step would)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def bridge(self, *_a: Any, **_kw: Any) -> BridgeRefusal:
        return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "cannot prove it")


def test_refusal_on_an_append_only_step_is_a_warning_not_a_failure(load_tokenizer: Any) -> None:
    tok = load_tokenizer("llama3")
    report = verify_template(tok, codec=_RefusingCodec(load_codec(tok)))
    assert report.ok and report.warnings
    assert all(s.outcome == "refused" and s.warn and not s.hard for s in report.steps)
    text = report.format_text()
    assert "[WARN]" in text and "BridgeRefusal(not_append_only)" in text and "warning(s)" in text


def test_unknown_family_is_an_error_not_a_crash(load_tokenizer: Any) -> None:
    report = verify_template(load_tokenizer("llama3"), family="no-such-family")
    assert not report.ok and report.error and "no-such-family" in report.error
    json.dumps(report.to_dict())


def test_first_difference_shows_context_on_both_sides(load_tokenizer: Any) -> None:
    tok = load_tokenizer("llama3")
    a = tok.encode("the weather is sunny in Paris today", add_special_tokens=False)
    b = tok.encode("the weather is rainy in Paris today", add_special_tokens=False)
    diff = first_difference(tok, a, b)
    assert diff is not None and a[: diff.index] == b[: diff.index] and a[diff.index] != b[diff.index]
    assert "sunny" in diff.expected_context or "sun" in diff.expected_context
    assert "is" in diff.expected_context.split("|")[0]
    assert first_difference(tok, a, list(a)) is None
    assert first_difference(tok, a, a[:-1]) is not None  # a shorter sequence differs at its end


def test_real_llama31_template_is_served_by_ours(tmp_path: Path) -> None:
    """The real Meta Llama 3.1 template (Llama 3.3's is the same file): detected as our
    llama3.1 family without the model's name, every bridged step token-exact; parallel
    calls are the template's own refusal (it raises on more than one call)."""
    import dataclasses

    from transformers import AutoTokenizer

    from tests.fast.trajectory.renderer_families import BY_NAME, build

    spec = dataclasses.replace(BY_NAME["llama-3.2"], name="llama-3.1",
                               template="meta-llama-Llama-3.1-8B-Instruct.jinja")
    tok = AutoTokenizer.from_pretrained(str(build(spec, tmp_path / "my-finetune")))
    report = verify_template(tok)
    assert report.ok and report.family == "llama3.1", report.format_text()
    roles = report.roles()
    assert all(roles[r]["append_only"] == "yes" and roles[r]["exact"] == roles[r]["compared"] > 0
               for r in ("user", "tool", "system", "assistant"))
    assert all(p.ok is not False for p in report.parses)
    assert {s.scenario for s in report.steps if s.outcome == "unsupported"} == {"parallel_tool_calls"}


def _served_families() -> list[str]:
    from tests.fast.trajectory.renderer_families import RENDERER_FAMILIES

    refused = {"kimi-k2-instruct", "kimi-k2-thinking"}  # test_detect.REFUSED_AT_LOAD
    return [f.name for f in RENDERER_FAMILIES if f.name not in refused]


@pytest.mark.parametrize("name", _served_families())
def test_verify_passes_on_every_served_family(load_renderer_tokenizer: Any, name: str) -> None:
    """The issue's bar, for every family of the bench table built offline (whatever codec
    detection picks): no hard failure, reasoning on and off, and something compared."""
    report = verify_template(load_renderer_tokenizer(name))
    assert report.ok, report.format_text()
    assert sum(v["compared"] for v in report.roles().values()) > 0
    assert report.parses and all(p.ok is not False for p in report.parses)
