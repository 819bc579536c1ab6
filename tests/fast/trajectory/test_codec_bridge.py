"""Bridge specifics: non-canonical segmentation, Qwen3 history rewrite, GLM stop
token, Llama 3.1 date, EOT repair."""

from __future__ import annotations

import datetime as real_datetime
from typing import Any

import pytest

from trajectory.codec import BridgeRefusal, BridgeResult, HistoryPolicy, RefusalReason, load_codec

USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def resegment(tok: Any, ids: list[int]) -> list[int]:
    """Same text, smaller pieces: every multi-char non-special token split into bytes."""
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    out: list[int] = []
    for i in ids:
        piece = tok.convert_ids_to_tokens(i)
        if i in special or len(piece) < 2:
            out.append(i)
        else:
            out.extend(tok.convert_tokens_to_ids(list(piece)))
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama3", "llama3.1", "glm4moe"])
def test_non_canonical_segmentation_is_kept_verbatim(load_tokenizer: Any, family: str) -> None:
    tok = load_tokenizer(family)
    codec = load_codec(tok)
    asst = {"role": "assistant", "content": "The weather is sunny today."}
    prompt = codec.render_first([USER])
    canonical = codec.canonical_assistant_ids(asst)
    sampled = resegment(tok, canonical)
    assert sampled != canonical
    assert tok.decode(sampled) == tok.decode(canonical)
    follow = [{"role": "user", "content": "thanks"}]
    trajectory = prompt + sampled + codec.close_turn(sampled)
    res_odd = codec.bridge([USER, asst], trajectory[-8:], follow)
    res_can = codec.bridge([USER, asst], (prompt + canonical)[-8:], follow)
    assert isinstance(res_odd, BridgeResult) and isinstance(res_can, BridgeResult)
    assert res_odd.prompt_ids == res_can.prompt_ids
    trajectory += res_odd.prompt_ids
    assert trajectory[len(prompt) : len(prompt) + len(sampled)] == sampled


def _qwen_after_reasoning(load_tokenizer: Any, policy: HistoryPolicy):
    tok = load_tokenizer("qwen3")
    codec = load_codec(tok)
    asst = {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Check it."}
    committed = codec.render_first([USER]) + codec.canonical_assistant_ids(asst)
    before = list(committed)
    new = [{"role": "user", "content": "And tomorrow?"}]
    return (
        tok,
        codec,
        asst,
        committed,
        before,
        new,
        codec.bridge([USER, asst], committed[-8:], new, policy=policy),
    )


def test_qwen3_user_after_reasoning_template_policy_refuses(load_tokenizer: Any) -> None:
    *_, committed, before, _new, res = _qwen_after_reasoning(load_tokenizer, HistoryPolicy.TEMPLATE)
    assert isinstance(res, BridgeRefusal)
    assert res.reason == RefusalReason.HISTORY_REWRITE
    assert committed == before


def test_qwen3_user_after_reasoning_append_policy_delta(load_tokenizer: Any) -> None:
    tok, codec, asst, committed, before, new, res = _qwen_after_reasoning(
        load_tokenizer, HistoryPolicy.APPEND
    )
    assert isinstance(res, BridgeResult) and res.rewrites_history
    assert committed == before
    text = tok.decode(committed + res.prompt_ids)
    assert "<think>\nCheck it.\n</think>" in text  # what the model saw is kept
    assert tok.decode(res.prompt_ids) == (
        "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    )
    full = tok.apply_chat_template([USER, asst, *new], add_generation_prompt=True, tokenize=False)
    assert "Check it." not in full  # the template itself would have dropped it


def test_qwen3_tool_after_reasoning_is_append_only(load_tokenizer: Any) -> None:
    tok = load_tokenizer("qwen3")
    codec = load_codec(tok)
    asst = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need data.",
        "tool_calls": [CALL],
    }
    committed = codec.render_first([USER]) + codec.canonical_assistant_ids(asst)
    res = codec.bridge([USER, asst], committed[-8:], [TOOL], policy=HistoryPolicy.TEMPLATE)
    assert isinstance(res, BridgeResult) and not res.rewrites_history
    native = {
        **asst,
        "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    }
    full = tok.apply_chat_template([USER, native, TOOL], add_generation_prompt=True, tokenize=False)
    assert committed + res.prompt_ids == tok.encode(full, add_special_tokens=False)


@pytest.mark.parametrize(
    ("asst", "new", "stop"),
    [
        (
            {"role": "assistant", "content": "Hi."},
            [{"role": "user", "content": "More"}],
            "<|user|>",
        ),
        ({"role": "assistant", "content": "", "tool_calls": [CALL]}, [TOOL], "<|observation|>"),
    ],
    ids=["user", "tool"],
)
def test_glm_sampled_role_token_not_duplicated(
    load_tokenizer: Any, asst: dict, new: list, stop: str
) -> None:
    tok = load_tokenizer("glm4moe")
    codec = load_codec(tok)
    stop_id = tok.convert_tokens_to_ids(stop)
    prompt = codec.render_first([USER])
    sampled = codec.canonical_assistant_ids(asst)
    assert sampled[-1] == stop_id and stop_id in codec.stop_token_ids
    assert codec.close_turn(sampled) == []
    res = codec.bridge([USER, asst], (prompt + sampled)[-8:], new)
    assert isinstance(res, BridgeResult) and not res.rewrites_history
    ids = prompt + sampled + res.prompt_ids
    assert res.prompt_ids[:1] != [stop_id]
    assert ids[len(prompt) :].count(stop_id) == 1
    # Cut short (no role token sampled): the bridge supplies it once.
    cut = sampled[:-1]
    res_cut = codec.bridge([USER, asst], (prompt + cut)[-8:], new)
    assert isinstance(res_cut, BridgeResult)
    assert prompt + cut + res_cut.prompt_ids == ids


@pytest.mark.parametrize("family", ["qwen3", "llama3", "llama3.1"])
def test_close_turn_repairs_missing_eot(load_tokenizer: Any, family: str) -> None:
    codec = load_codec(load_tokenizer(family))
    sampled = codec.canonical_assistant_ids({"role": "assistant", "content": "Hello there"})
    assert codec.close_turn(sampled) == []
    repair = codec.close_turn(sampled[:-1])
    assert repair == [sampled[-1]] and repair[0] in codec.eot_ids
    res = codec.bridge(
        [USER, {"role": "assistant", "content": "Hello"}],
        sampled[:-1],
        [{"role": "user", "content": "x"}],
    )
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.NOT_APPEND_ONLY


def test_llama31_date_change_between_turns(
    load_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5 injects `strftime_now` as `datetime.now().strftime` from
    transformers.utils.chat_template_utils; patch that module's `datetime`."""
    from transformers.utils import chat_template_utils

    def fixed(day: int) -> type:
        class _FakeDatetime(real_datetime.datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:
                return real_datetime.datetime(2025, 3, day, 12, 0, 0)

        return _FakeDatetime

    tok = load_tokenizer("llama3.1")
    codec = load_codec(tok)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    monkeypatch.setattr(chat_template_utils, "datetime", fixed(1))
    prompt = codec.render_first([USER], tools=tools)
    assert "Today Date: 01 Mar 2025" in tok.decode(prompt)
    asst = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    sampled = codec.canonical_assistant_ids(asst)
    res1 = codec.bridge([USER, asst], sampled[-8:], [TOOL], tools=tools)
    monkeypatch.setattr(chat_template_utils, "datetime", fixed(2))
    assert "Today Date: 02 Mar 2025" in tok.decode(codec.render_first([USER], tools=tools))
    res2 = codec.bridge([USER, asst], sampled[-8:], [TOOL], tools=tools)
    assert isinstance(res1, BridgeResult) and isinstance(res2, BridgeResult)
    assert res1.prompt_ids == res2.prompt_ids
    assert not res2.rewrites_history


def test_llama31_two_tool_calls_refused(load_tokenizer: Any) -> None:
    codec = load_codec(load_tokenizer("llama3.1"))
    asst = {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]}
    res = codec.bridge([USER, asst], [], [TOOL, {**TOOL, "tool_call_id": "call_2"}])
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.RENDER_FAILED


def test_rewrite_offset_is_the_first_token_a_full_render_changes(load_tokenizer: Any) -> None:
    """The per-turn TITO diagnostic: found on the one-turn window, it is exactly where the
    whole re-rendered conversation first departs from the committed tokens."""
    tok, codec, asst, committed, _before, new, res = _qwen_after_reasoning(
        load_tokenizer, HistoryPolicy.APPEND
    )
    assert isinstance(res, BridgeResult) and res.rewrites_history and res.rewrite_offset is not None
    output_start = len(codec.render_first([USER]))
    full = tok.encode(
        tok.apply_chat_template([USER, asst, *new], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    first = next(i for i, (x, y) in enumerate(zip(committed, full, strict=False)) if x != y)
    assert output_start + res.rewrite_offset == first
    assert tok.decode(committed[first:first + 3]).startswith("<think>")


@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE])
def test_qwen3_injected_assistant_last_renders_as_the_template_does(
    load_tokenizer: Any, policy: HistoryPolicy
) -> None:
    """Qwen3 gives the last assistant message after the last query an empty think block;
    an assistant message the client injects after a reasoning turn is bridged with it
    (found by verify-template), for the window's position, not B's."""
    tok = load_tokenizer("qwen3")
    codec = load_codec(tok)
    asst = {"role": "assistant", "content": "", "reasoning_content": "Need data.", "tool_calls": [CALL]}
    committed = codec.render_first([USER]) + codec.canonical_assistant_ids(asst)
    res1 = codec.bridge([USER, asst], committed[-8:], [TOOL], policy=policy)
    assert isinstance(res1, BridgeResult) and not res1.rewrites_history
    committed += res1.prompt_ids
    reply = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Got it."}
    committed += codec.canonical_assistant_ids(reply)
    injected = {"role": "assistant", "content": "Anything else?"}
    history = [USER, asst, TOOL, reply]
    res = codec.bridge(history, committed[-8:], [injected], policy=policy)
    assert isinstance(res, BridgeResult) and not res.rewrites_history
    native = {**asst, "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    full = tok.apply_chat_template([USER, native, TOOL, reply, injected], add_generation_prompt=True, tokenize=False)
    assert "<think>\n\n</think>\n\nAnything else?" in full
    assert committed + res.prompt_ids == tok.encode(full, add_special_tokens=False)


@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE])
@pytest.mark.parametrize(
    ("asst", "new", "sampled_stop", "needed"),
    [
        ({"role": "assistant", "content": "", "tool_calls": [CALL]},
         [{"role": "user", "content": "Never mind."}], "<|observation|>", "<|user|>"),
        ({"role": "assistant", "content": "Hi."},
         [{"role": "system", "content": "Be brief."}], "<|user|>", "<|system|>"),
    ],
    ids=["observation-then-user", "user-then-system"],
)
def test_glm_sampled_role_token_other_than_the_next_message_refuses_role_mismatch(
    load_tokenizer: Any, asst: dict, new: list, sampled_stop: str, needed: str, policy: HistoryPolicy
) -> None:
    """The model sampled one role token, the next message renders with another: no delta
    after the sampled token is what the template renders (never two role tokens in a
    row, never the sampled token dropped), so the bridge refuses and the caller forks."""
    tok = load_tokenizer("glm4moe")
    codec = load_codec(tok)
    prompt = codec.render_first([USER])
    sampled = codec.canonical_assistant_ids(asst)
    assert tok.convert_ids_to_tokens(sampled[-1]) == sampled_stop
    committed = prompt + sampled
    res = codec.bridge([USER, asst], committed[-8:], new, policy=policy, committed=committed)
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.ROLE_MISMATCH
    assert sampled_stop in res.detail and needed in res.detail
