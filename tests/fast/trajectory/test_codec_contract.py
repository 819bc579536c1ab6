"""Contract suite for every codec family: incremental TITO tokens equal a full
re-render at every append-only step, and history rewrites are detected."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajectory.codec import BridgeRefusal, BridgeResult, HistoryPolicy, RefusalReason, load_codec

FAMILY_PARAMS = [
    pytest.param("qwen3", id="qwen3"),
    pytest.param("llama3", id="llama3"),
    pytest.param("llama3.1", id="llama3.1"),
    pytest.param("glm4moe", id="glm4moe"),
]
MAX_CALLS = {"qwen3": 3, "llama3": 0, "llama3.1": 1, "glm4moe": 3}
REASONING = {"qwen3": True, "llama3": False, "llama3.1": False, "glm4moe": True}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

_words = st.sampled_from(
    ["the", "city", "weather", "is", "42", "sunny", "x", "Paris", "true", "call", "ok", "3.5"]
)
text = st.lists(_words, min_size=1, max_size=6).map(" ".join)
arg_value = st.one_of(
    text, st.integers(-50, 5000), st.booleans(), st.lists(st.integers(0, 9), max_size=3)
)
arguments = st.dictionaries(st.sampled_from(["city", "n", "flag", "q"]), arg_value, max_size=3)


@st.composite
def conversations(
    draw: Any, family: str, reasoning: bool | None = None, max_calls: int | None = None
) -> tuple[list[dict], list[list[dict]], bool]:
    """(prefix up to the first assistant, [assistant, *followers] per turn, use tools)."""
    reasoning = REASONING[family] if reasoning is None else reasoning
    max_calls = MAX_CALLS[family] if max_calls is None else max_calls
    use_tools = max_calls > 0 and draw(st.booleans())
    prefix: list[dict] = []
    if draw(st.booleans()):
        prefix.append({"role": "system", "content": draw(text)})
    prefix.append({"role": "user", "content": draw(text)})
    turns = []
    for t in range(draw(st.integers(1, 3))):
        asst: dict[str, Any] = {"role": "assistant", "content": draw(text)}
        if reasoning and draw(st.booleans()):
            asst["reasoning_content"] = draw(text)
        n_calls = draw(st.integers(0, max_calls)) if use_tools else 0
        if n_calls:
            asst["tool_calls"] = [
                {
                    "id": f"call_{t}{i}",
                    "type": "function",
                    "function": {
                        "name": draw(st.sampled_from(["get_weather", "search"])),
                        "arguments": draw(arguments),
                    },
                }
                for i in range(n_calls)
            ]
            if draw(st.booleans()):
                asst["content"] = ""
            follow = [
                {"role": "tool", "tool_call_id": f"call_{t}{i}", "content": draw(text)}
                for i in range(n_calls)
            ]
        else:
            follow = [{"role": "user", "content": draw(text)}]
        turns.append([asst, *follow])
    return prefix, turns, use_tools


def full_ids(tok: Any, messages: list[dict], tools: Any, **template_kwargs: Any) -> list[int]:
    rendered = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tok.encode(rendered, add_special_tokens=False)


def play(
    tok: Any, family: str, conv: Any, policy: HistoryPolicy, codec: Any = None,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Run the conversation incrementally; returns counts of checked/rewritten steps.
    `template_kwargs` (e.g. enable_thinking) go to every codec call and full render."""
    codec = load_codec(tok) if codec is None else codec
    kw = dict(template_kwargs or {})
    # codecs whose canonical sample depends on the kwargs take them (verify._canonical)
    canon_kw = {"template_kwargs": kw} if kw else {}
    prefix, turns, use_tools = conv
    tools = TOOLS if use_tools else None
    msgs = list(prefix)
    form = getattr(codec, "template_messages", list)  # the template's field names (gpt-oss: `thinking`)
    ids = codec.render_first(msgs, tools=tools, template_kwargs=kw or None)
    assert ids == full_ids(tok, form(msgs), tools, **kw)
    stats = {"checked": 0, "rewrites": 0}
    for asst, *follow in turns:
        sampled = codec.canonical_assistant_ids(asst, **canon_kw)
        assert codec.close_turn(sampled) == []
        ids += sampled
        history = [*msgs, asst]
        committed = list(ids)
        # TEMPLATE gets every committed id, as the server passes them (exact by definition)
        whole = committed if policy == HistoryPolicy.TEMPLATE else None
        res = codec.bridge(history, ids[-8:], follow, tools=tools, policy=policy, committed=whole,
                           template_kwargs=kw or None)
        msgs = history + follow
        full = full_ids(tok, form(msgs), tools, **kw)
        if isinstance(res, BridgeRefusal):
            assert policy == HistoryPolicy.TEMPLATE
            assert res.reason == RefusalReason.HISTORY_REWRITE
            assert full[: len(committed)] != committed
            stats["rewrites"] += 1
            ids = full  # the caller forks a branch from the re-rendered prompt
            continue
        assert isinstance(res, BridgeResult)
        ids = committed + res.prompt_ids
        if policy == HistoryPolicy.TEMPLATE:
            # TEMPLATE checks the whole history: its flag is exact both ways
            assert not res.rewrites_history or ids != full
            if not res.rewrites_history:
                assert ids == full, f"{family}: incremental != full render"
                stats["checked"] += 1
                continue
        elif full[: len(committed)] == committed:
            # the template keeps every committed token: we must produce exactly its tail
            assert ids == full, f"{family}: incremental != full render"
            stats["checked"] += 1
            continue
        else:
            # the template rewrites earlier turns; APPEND keeps what the model saw and
            # the new tokens are still exactly the template's rendering of the new turn
            assert full[-len(res.prompt_ids) :] == res.prompt_ids, f"{family}: delta != template tail"
            # (APPEND's flag is a last-turn diagnostic: a flagged rewrite is real, but an
            # earlier turn's rewrite may go unflagged; correctness never depends on it)
        if res.rewrites_history:
            assert ids != full, "a detected rewrite must be a real divergence"
        stats["rewrites"] += 1
        ids = full
    return stats


@pytest.mark.parametrize("family", FAMILY_PARAMS)
@pytest.mark.parametrize(
    "policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE], ids=["append", "template"]
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_incremental_equals_full_render(
    load_tokenizer: Any, family: str, policy: HistoryPolicy, data: Any
) -> None:
    conv = data.draw(conversations(family))
    play(load_tokenizer(family), family, conv, policy)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_tool_turns_are_append_only_where_expected(load_tokenizer: Any, family: str) -> None:
    """A fixed multi-turn tool conversation: every step is checked, none rewrites
    (for Qwen3/GLM only when each assistant turn carries reasoning)."""
    calls = MAX_CALLS[family]
    turns = []
    for t in range(3):
        asst: dict[str, Any] = {"role": "assistant", "content": "ok"}
        if REASONING[family]:
            asst["reasoning_content"] = "think"
        if calls and t < 2:
            asst["tool_calls"] = [
                {
                    "id": f"call_{t}{i}",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "n": i}},
                }
                for i in range(min(calls, 2))
            ]
            follow = [
                {"role": "tool", "tool_call_id": f"call_{t}{i}", "content": "sunny"}
                for i in range(min(calls, 2))
            ]
        else:
            follow = [{"role": "user", "content": "thanks"}]
        turns.append([asst, *follow])
    conv = ([{"role": "user", "content": "weather in Paris"}], turns, bool(calls))
    stats = play(load_tokenizer(family), family, conv, HistoryPolicy.APPEND)
    expected_rewrites = 1 if REASONING[family] else 0  # the final user turn after reasoning
    assert stats["rewrites"] == expected_rewrites
    assert stats["checked"] == 3 - expected_rewrites
