"""Gemma 4: served token-exact by our `Gemma4Codec` (trajectory/codec/gemma4.py),
detected from the template alone; its tool-call grammar and reasoning parsed back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.fast.trajectory.renderer_families import BY_NAME, build
from tests.fast.trajectory.test_codec_contract import TOOLS, conversations, full_ids, play
from trajectory.codec import (
    BridgeRefusal,
    BridgeResult,
    Gemma4Codec,
    HistoryPolicy,
    RefusalReason,
    ToolCallParseStatus,
    detect_family,
    load_codec,
)
from trajectory.codec.gemma4 import ArgumentError, parse_call_arguments
from trajectory.codec.renderers_codec import RenderersCodec
from trajectory.codec.verify import verify_template

NAME = "gemma-4"
ON = {"enable_thinking": True}
INTERLEAVED = "google-gemma-4-31B-it-interleaved.jinja"


@pytest.fixture(scope="module")
def tok(load_renderer_tokenizer: Any) -> Any:
    return load_renderer_tokenizer(NAME)


@pytest.fixture(scope="module")
def codec(tok: Any) -> Gemma4Codec:
    c = load_codec(tok)
    assert isinstance(c, Gemma4Codec)
    return c


def _call(i: str, name: str, args: dict[str, Any], *, as_json: bool = True) -> dict[str, Any]:
    """A call as clients send it (JSON-string arguments) or as templates take it (a dict:
    `full_ids` renders messages as given)."""
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if as_json else args}}


def _text(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False))


# -- detection, generation prompt, stops, close -------------------------------


def test_gemma4_detected_from_the_template_alone(tok: Any, tmp_path: Any) -> None:
    """The packaged template (digest) and a renamed local copy: never from name_or_path."""
    det = detect_family(tok)
    assert det.family == "gemma4", det
    local = build(BY_NAME[NAME], tmp_path / "my-finetune")
    assert isinstance(load_codec(str(local)), Gemma4Codec)


def test_gemma4_prompt_stops_and_close(tok: Any, codec: Gemma4Codec) -> None:
    """Thinking off (the template's default) prefills an empty thought channel; a reply
    stops on <turn|>, a tool call on <|tool_response>; close_turn repairs both."""
    ids = tok.convert_tokens_to_ids
    assert _text(tok, list(codec.generation_prompt_ids)) == "<|turn>model\n<|channel>thought\n<channel|>"
    assert set(codec.eot_ids) == {ids("<turn|>"), ids("<|tool_response>")}
    assert set(codec.stop_token_ids) >= {ids("<turn|>"), ids("<|tool_response>"), ids("<eos>")}
    assert codec.close_turn([5, ids("<turn|>")]) == []
    assert codec.close_turn([5, ids("<|tool_response>")]) == []
    assert codec.close_turn([5, ids("<tool_call|>")]) == [ids("<|tool_response>")]
    assert codec.close_turn([5, 6]) == [ids("<turn|>")]


def test_gemma4_what_the_model_samples(tok: Any, codec: Gemma4Codec) -> None:
    """The body after the prompt: a reply through <turn|> (no gap), a call through the tool
    stop with the template's reasoning wrapper; thinking on, a plain answer's reasoning first."""
    reply = {"role": "assistant", "content": "It is sunny."}
    assert _text(tok, codec.canonical_assistant_ids(reply)) == "It is sunny.<turn|>"
    call = {"role": "assistant", "content": "", "reasoning_content": "R",
            "tool_calls": [_call("1", "get_weather", {"city": "Paris", "n": None, "ok": True})]}
    assert _text(tok, codec.canonical_assistant_ids(call)) == (
        '<|channel>thought\nR\n<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,n:None,ok:true}'
        "<tool_call|><|tool_response>")
    thought = {**reply, "reasoning_content": "R"}
    assert _text(tok, codec.canonical_assistant_ids(thought)) == "It is sunny.<turn|>"
    assert _text(tok, codec.canonical_assistant_ids(thought, template_kwargs=ON)) == (
        "<|channel>thought\nR\n<channel|>It is sunny.<turn|>")


def test_gemma4_tool_results_continue_the_turn(tok: Any, codec: Gemma4Codec) -> None:
    """After the sampled <|tool_response>: the results, and no generation prompt (the model
    continues its turn); thinking on, the whole tool step is token-exact and unflagged."""
    user = {"role": "user", "content": "Weather?"}
    asst = {"role": "assistant", "content": "", "reasoning_content": "Let me look.",
            "tool_calls": [_call("1", "get_weather", {"city": "Paris"}, as_json=False),
                           _call("2", "search", {"q": "x"}, as_json=False)]}
    tools = [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
             {"role": "tool", "tool_call_id": "call_2", "content": "a concert"}]
    committed = codec.render_first([user], tools=TOOLS, template_kwargs=ON)
    committed += codec.canonical_assistant_ids(asst, template_kwargs=ON)
    for policy in HistoryPolicy:
        res = codec.bridge([user, asst], committed[-8:], tools, tools=TOOLS, template_kwargs=ON,
                           policy=policy, committed=committed if policy == HistoryPolicy.TEMPLATE else None)
        assert isinstance(res, BridgeResult) and not res.rewrites_history, policy
        assert _text(tok, res.prompt_ids) == (
            'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
            '<|tool_response>response:search{value:<|"|>a concert<|"|>}<tool_response|>')
        assert committed + res.prompt_ids == full_ids(tok, [user, asst, *tools], TOOLS, **ON)


def test_gemma4_dropped_prefill_is_a_rewrite(tok: Any, codec: Gemma4Codec) -> None:
    """Stated limitation (thinking off): the template drops the prompt's empty thought channel
    from history, so no later step is append-only. APPEND keeps what the model saw and flags
    it (first difference in the prompt: no offset); TEMPLATE refuses, the server forks."""
    user = {"role": "user", "content": "Hi"}
    asst = {"role": "assistant", "content": "Hello."}
    new = [{"role": "user", "content": "Bye"}]
    committed = codec.render_first([user]) + codec.canonical_assistant_ids(asst)
    full = full_ids(tok, [user, asst, *new], None)
    assert full[: len(committed)] != committed
    res = codec.bridge([user, asst], committed[-8:], new)
    assert isinstance(res, BridgeResult) and res.rewrites_history and res.rewrite_offset is None
    assert full[-len(res.prompt_ids):] == res.prompt_ids
    ref = codec.bridge([user, asst], committed[-8:], new, policy=HistoryPolicy.TEMPLATE, committed=committed)
    assert isinstance(ref, BridgeRefusal) and ref.reason == RefusalReason.HISTORY_REWRITE


def test_gemma4_content_before_calls_is_a_rewrite(tok: Any, codec: Gemma4Codec) -> None:
    """The template renders a tool-call message's content after its results: the bridge
    bases on the calls alone (what the model continues from) and flags the rewrite."""
    user = {"role": "user", "content": "Weather?"}
    asst = {"role": "assistant", "content": "Checking.", "tool_calls": [_call("1", "get_weather", {"city": "P"})]}
    tool = [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    committed = codec.render_first([user], tools=TOOLS, template_kwargs=ON)
    committed += codec.canonical_assistant_ids(asst, template_kwargs=ON)
    res = codec.bridge([user, asst], committed[-8:], tool, tools=TOOLS, template_kwargs=ON)
    assert isinstance(res, BridgeResult) and res.rewrites_history and res.rewrite_offset is not None
    assert _text(tok, res.prompt_ids) == 'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
    # the template's own tail: the content again after the results, the turn closed, no prompt
    asst_t = {**asst, "tool_calls": [_call("1", "get_weather", {"city": "P"}, as_json=False)]}
    assert _text(tok, full_ids(tok, [user, asst_t, *tool], TOOLS, **ON)).endswith(
        "<tool_response|>Checking.<turn|>\n")


def test_gemma4_refuses_an_open_turn(codec: Gemma4Codec) -> None:
    hist = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    res = codec.bridge(hist, [5, 6], [{"role": "user", "content": "u"}])
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.NOT_APPEND_ONLY


# -- the contract suite under both policies, thinking on and off ----------


@pytest.mark.parametrize("thinking", [None, ON], ids=["default", "thinking"])
@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gemma4_codec_keeps_the_codec_contract(tok: Any, codec: Gemma4Codec, policy: HistoryPolicy, thinking: Any,
                            data: Any) -> None:
    conv = data.draw(conversations(NAME, reasoning=True, max_calls=3))
    # APPEND checks the delta against the template's tail; with content beside tool calls
    # the template's tail repeats that content after the results and closes the turn
    # with no generation prompt: our delta is the results alone (a stated limitation,
    # pinned by test_gemma4_content_before_calls_is_a_rewrite; TEMPLATE forks there)
    assume(policy == HistoryPolicy.TEMPLATE or not _content_with_calls(conv))
    play(tok, NAME, conv, policy, codec=codec, template_kwargs=thinking)


def _content_with_calls(conv: Any) -> bool:
    return any(asst.get("content") and asst.get("tool_calls") for asst, *_ in conv[1])


def test_gemma4_thinking_tool_loop_is_checked_token_exact(tok: Any, codec: Gemma4Codec) -> None:
    """Thinking on, a tool loop of reasoning + calls: every tool step is append-only and
    checked token for token; the final user turn drops the reasoning (one rewrite)."""
    turns = []
    for t in range(3):
        asst: dict[str, Any] = {"role": "assistant", "content": "" if t < 2 else "done",
                                "reasoning_content": f"think {t}"}
        if t < 2:
            asst["tool_calls"] = [
                {"id": f"call_{t}{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "n": i}}} for i in range(2)]
            follow = [{"role": "tool", "tool_call_id": f"call_{t}{i}", "content": "sunny"} for i in range(2)]
        else:
            follow = [{"role": "user", "content": "thanks"}]
        turns.append([asst, *follow])
    conv = ([{"role": "user", "content": "weather in Paris"}], turns, True)
    stats = play(tok, NAME, conv, HistoryPolicy.APPEND, codec=codec, template_kwargs=ON)
    assert stats == {"checked": 2, "rewrites": 1}


def test_gemma4_verify_template_no_hard_failures(tok: Any) -> None:
    """verify-template, thinking both: 0 hard failures, every parse round-trips; the only
    token-exact steps are those the template keeps (the rest are flagged rewrites)."""
    report = verify_template(tok, thinking="both")
    assert report.family == "gemma4" and report.ok, report.hard_failures
    assert all(p.ok for p in report.parses) and len(report.parses) == 16
    assert not report.warnings
    exact = {(s.scenario, s.step, s.thinking) for s in report.steps if s.outcome == "exact"}
    assert ("tool_append_json", 0, "on") in exact
    assert {s.outcome for s in report.steps} <= {"exact", "rewrite"}
    assert all("not flagged" not in s.detail for s in report.steps)


def test_gemma4_interleaved_variant_served(load_renderer_tokenizer: Any, tmp_path: Any) -> None:
    """The `-interleaved` revision (tool results as `<|turn>tool` turns, `<turn|>` after a call,
    reasoning without the '\\n' before <channel|>) is detected by its markers and verified."""
    from session_server.sim.tokenizers import build_template_tokenizer
    from tests.fast.trajectory.renderer_families import TEMPLATES, special_tokens

    path = TEMPLATES / INTERLEAVED
    fam = BY_NAME[NAME]
    out = build_template_tokenizer(tmp_path / "tok", path.read_text(encoding="utf-8"), special_tokens(fam),
                                   bos=fam.bos, eos=fam.eos)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert detect_family(tok).source == "markers"
    report = verify_template(tok, thinking="both")
    assert report.family == "gemma4" and report.ok, report.hard_failures


def test_gemma4_renderer_keeps_the_prefill_the_template_drops(tok: Any) -> None:
    """Why ours serves Gemma 4 (test_renderers_codec.OURS): renderers 0.1.12 re-emits the
    empty thought channel in history turns, the template does not."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]
    theirs = RenderersCodec(tok, "gemma4").render_first(msgs)
    assert theirs != full_ids(tok, msgs, None)
    assert _text(tok, theirs).count("<|channel>thought\n<channel|>") == 2


# -- tool calls and reasoning parsed ------------------------------------------

ARGS = [
    {"city": "Paris", "metric": True, "detailed": False, "date": None, "days": 3},
    {"n": -1.5, "big": 12345678901234, "e": 1e-07, "zero": 0},
    {"nested": {"a": [1, {"b": None}], "c": {"d": "x,y}z"}}, "empty": {}, "list": []},
    {"q": "东京 — «oui» 🌧️ naïve", "path": "a:b/c", "quote": 'say "hi"', "nl": "line1\nline2"},
    {"Zebra": 1, "apple": 2, "Mango": [True, False, None]},
]


@pytest.mark.parametrize("args", ARGS, ids=[f"args{i}" for i in range(len(ARGS))])
@pytest.mark.parametrize("thinking", [None, ON], ids=["default", "thinking"])
def test_gemma4_tool_call_round_trip(tok: Any, codec: Gemma4Codec, args: dict[str, Any],
                                        thinking: Any) -> None:
    """canonical ids -> parse gives the call back: true/false/null, numbers, nesting, unicode."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    msg = {"role": "assistant", "content": "", "reasoning_content": "Plan: call.",
           "tool_calls": [_call("1", "get_weather", args), _call("2", "search", {"q": "x"})]}
    ids = codec.canonical_assistant_ids(msg, template_kwargs=thinking)
    parsed = codec.parse_assistant(ids, tools=tools, template_kwargs=thinking)
    assert parsed.status == ToolCallParseStatus.OK, parsed.status_detail
    assert parsed.reasoning_content == "Plan: call." and not parsed.content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", args), ("search", {"q": "x"})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_gemma4_reasoning_and_content_parsed(tok: Any, codec: Gemma4Codec) -> None:
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    p = codec.parse_assistant(enc("<|channel>thought\nA\n\nB\n<channel|>Answer.<turn|>"), template_kwargs=ON)
    assert (p.reasoning_content, p.content, p.status) == ("A\n\nB", "Answer.", ToolCallParseStatus.OK)
    cut = codec.parse_assistant(enc("<|channel>thought\nhalf a thou"), template_kwargs=ON)
    assert (cut.reasoning_content, cut.content) == ("half a thou", "")
    plain = codec.parse_assistant(enc("Just text.<turn|>"))
    assert (plain.reasoning_content, plain.content) == (None, "Just text.")


BAD = [
    ('<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>', ToolCallParseStatus.INVALID_JSON),
    ("<|tool_call>call:get_weather{city:Paris}<tool_call|>", ToolCallParseStatus.INVALID_JSON),
    ("<|tool_call>call:get_weather{city:1,}<tool_call|>", ToolCallParseStatus.INVALID_JSON),
    ("<|tool_call>call:get_weather{city:1}x<tool_call|>", ToolCallParseStatus.INVALID_JSON),
    ("<|tool_call>call:get_weather{city:1}", ToolCallParseStatus.INVALID_FORMAT),
    ("<|tool_call>get_weather{city:1}<tool_call|>", ToolCallParseStatus.INVALID_FORMAT),
    ("<|tool_call>call:{city:1}<tool_call|>", ToolCallParseStatus.INVALID_FORMAT),
    ("<|tool_call>call:unknown_fn{}<tool_call|>", ToolCallParseStatus.INVALID_FORMAT),
    ("text<tool_call|>", ToolCallParseStatus.INVALID_FORMAT),
]


@pytest.mark.parametrize(("text", "status"), BAD)
def test_gemma4_malformed_calls_are_typed(tok: Any, codec: Gemma4Codec, text: str,
                                             status: ToolCallParseStatus) -> None:
    """Malformed markup: a typed status, the text kept as content, never an exception."""
    ids = tok.encode(text, add_special_tokens=False)
    parsed = codec.parse_assistant(ids, tools=TOOLS)
    assert parsed.status == status, parsed.status_detail
    assert not parsed.tool_calls and parsed.content


def test_gemma4_no_tools_offered_is_content(tok: Any, codec: Gemma4Codec) -> None:
    ids = tok.encode("<|tool_call>call:get_weather{}<tool_call|>", add_special_tokens=False)
    parsed = codec.parse_assistant(ids)
    assert parsed.status == ToolCallParseStatus.OK and not parsed.tool_calls and parsed.content


@pytest.mark.parametrize("text", ["{a:}", "{:1}", "{a:1", "{a:[1,2}", "{a:tru}", '{a:"x"}', "{a:1}}"])
def test_gemma4_argument_grammar_rejects(text: str) -> None:
    with pytest.raises(ArgumentError):
        parse_call_arguments(text)
