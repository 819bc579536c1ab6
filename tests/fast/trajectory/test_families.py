"""The family registry (`trajectory.codec.families`) refuses a table that contradicts
itself, names each codec's incremental parser from its row, and the bridge shape checks
the codecs share refuse in one order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trajectory.codec import GenericCodec, Glm4Codec, Llama31Codec, Qwen3Codec, RefusalReason
from trajectory.codec.base import check_bridge_input
from trajectory.codec.families import (
    FAMILIES,
    IncrementalKind,
    MarkerRule,
    RegistryError,
    SimTokenizer,
    Source,
    _validate,
    incremental_parser,
    ours,
)
from trajectory.codec.template import TemplateCodec


def _row(name: str) -> int:
    return next(i for i, f in enumerate(FAMILIES) if f.name == name and f.source is not Source.RENDERERS)


def _with(name: str, **changes: object) -> tuple:
    rows = list(FAMILIES)
    rows[_row(name)] = replace(rows[_row(name)], **changes)  # type: ignore[arg-type]
    return tuple(rows)


def test_the_shipped_table_is_consistent() -> None:
    _validate(FAMILIES)


@pytest.mark.parametrize(("table", "says"), [
    (lambda: (*FAMILIES, FAMILIES[0]), "listed twice"),
    (lambda: _with("qwen3", codec=Glm4Codec), "whose `family` is 'qwen3'"),
    (lambda: _with("llama3", markers=MarkerRule(("x",), rank=0)), "share a rank"),
    (lambda: _with("gemma4", template_file="nope.jinja"), "no packaged template"),
    (lambda: _with("deepseek", sim=SimTokenizer((), None, "e", "e", False, "")), "carries the packaged template"),
    (lambda: _with("qwen3", incremental=IncrementalKind.PROBED), "decided by its probe"),
    (lambda: tuple(f for f in FAMILIES if f.source is not Source.GENERIC), "exactly one 'generic'"),
])
def test_a_contradictory_family_table_is_refused_at_import(table, says: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RegistryError, match=says):
        _validate(table())


def _bare(cls: type) -> object:
    return cls.__new__(cls)


def test_each_codec_gets_the_incremental_parser_its_row_declares() -> None:
    assert incremental_parser(_bare(Qwen3Codec)).kind is IncrementalKind.HERMES
    assert incremental_parser(_bare(Glm4Codec)).kind is IncrementalKind.GLM
    assert incremental_parser(_bare(Llama31Codec)).kind is IncrementalKind.NONE
    assert incremental_parser(_bare(TemplateCodec)).kind is IncrementalKind.PLAIN

    class Custom(Qwen3Codec):  # a class the registry does not list: the whole-parse fallback
        pass

    assert incremental_parser(_bare(Custom)).kind is IncrementalKind.NONE


@pytest.mark.parametrize(("think", "hermes", "xml", "want"), [
    (True, True, False, (IncrementalKind.HERMES, True, True)),
    (True, False, False, (IncrementalKind.HERMES, True, False)),
    (False, False, False, (IncrementalKind.HERMES, False, False)),
    (True, True, True, (IncrementalKind.NONE, False, False)),
])
def test_the_generic_codec_streams_as_far_as_its_template_markers_go(
    think: bool, hermes: bool, xml: bool, want: tuple[IncrementalKind, bool, bool]
) -> None:
    codec = _bare(GenericCodec)
    codec.reasoning_markers, codec.hermes_calls, codec.xml_calls = think, hermes, xml  # type: ignore[attr-defined]
    parser = incremental_parser(codec)
    assert (parser.kind, parser.reasoning, parser.tool_calls) == want


def test_renderers_names_ours_also_has_are_served_by_ours() -> None:
    shared = {f.name for f in FAMILIES if f.source is Source.RENDERERS} & {"qwen3", "kimi-k2", "gemma4"}
    assert shared == {"qwen3", "kimi-k2", "gemma4"}
    assert all(ours(n) is not None and ours(n).source is Source.OURS for n in shared)  # type: ignore[union-attr]


ASSISTANT = [{"role": "assistant", "content": "hi"}]
USER = [{"role": "user", "content": "q"}]


@pytest.mark.parametrize(("history", "tail", "new", "kw", "reason", "detail"), [
    ([], [1], USER, {}, RefusalReason.UNSUPPORTED_MESSAGE, "history must end"),
    (ASSISTANT, [1], [], {}, RefusalReason.UNSUPPORTED_MESSAGE, "no new messages"),
    (ASSISTANT, [1], [{"role": "bot"}, {"role": "system"}], {"refused_roles": {"system": "first only"}},
     RefusalReason.UNSUPPORTED_MESSAGE, "first only"),
    (ASSISTANT, [1], [{"role": "bot"}], {"unknown_role": "only users"}, RefusalReason.UNSUPPORTED_MESSAGE,
     "only users"),
    (ASSISTANT, [2], USER, {}, RefusalReason.NOT_APPEND_ONLY, "not closed"),
    (ASSISTANT, [], USER, {"tail_required": True}, RefusalReason.NOT_APPEND_ONLY, "not closed"),
])
def test_bridge_shape_checks_refuse_in_one_order(history, tail, new, kw, reason, detail) -> None:  # type: ignore[no-untyped-def]
    refusal = check_bridge_input(history, tail, new, roles=("user", "tool"), closing_ids=(1,), **kw)
    assert refusal is not None and refusal.reason is reason and detail in refusal.detail


def test_bridge_shape_checks_pass_a_closed_turn_and_skip_the_close_check_without_closing_ids() -> None:
    assert check_bridge_input(ASSISTANT, [1], USER, roles=("user",), closing_ids=(1,)) is None
    assert check_bridge_input(ASSISTANT, [], USER, roles=("user",), closing_ids=(1,)) is None
    assert check_bridge_input(ASSISTANT, [7], USER, roles=("user",), closing_ids=None) is None
