"""The renderers-backed codec under OUR contract suite, per family.

Every family of tests/fast/trajectory/renderer_families.py runs the same checks as
our hand-written codecs (test_codec_contract.play): render_first equals the
template's own render, every append-only bridge step equals the full template
render token for token, rewrites are detected. Families where the renderer and
the real template disagree are pinned as strict xfails with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.fast.trajectory.renderer_families import BY_NAME, RENDERER_FAMILIES
from tests.fast.trajectory.test_codec_contract import TOOLS, conversations, full_ids, play
from trajectory.codec import BridgeRefusal, BridgeResult, HistoryPolicy, RefusalReason
from trajectory.codec.renderers_codec import RenderersCodec
from trajectory.errors import TemplateNotSupported

# family -> why the renderer refuses this tokenizer at load (TemplateNotSupported: its
# prompts differ from the tokenizer's own template on the verify probes; we prefer the
# template, the truth of what the model was trained with)
_DS = ("no V3.1/V3.2 renderer in renderers 0.1.12: deepseek-v3's generation prompt lacks the "
       "template's `<think></think>` prefill (our DeepSeekCodec serves them, see test_deepseek_codec)")
REFUSED: dict[str, str] = {
    "deepseek-v3.1": _DS,
    "deepseek-v3.2": _DS,
    "kimi-k2": "old template version: default system 'You are a helpful assistant', the renderer's 'You are Kimi...'",
    "kimi-k2-instruct": "tool declaration: the renderer prints deep-sorted compact JSON (K2.5 template and the real "
                        "tokenizer's deep_sort_dict), this template `tools | tojson` (', ' separators, client order)",
    "kimi-k2-thinking": "the renderer puts '\\n' after the default system's <|im_end|>, this template does not "
                        "(the renderer follows K2-Instruct); tool declaration differs as for K2-Instruct",
    "kimi-k2-instruct-ids": "as kimi-k2-instruct (the same template, tool-call ids taken from the messages)",
    "kimi-k2-thinking-ids": "as kimi-k2-thinking (the same template, tool-call ids taken from the messages)",
    "qwen3-coder": "no Qwen3-Coder renderer: qwen3.5/qwen3.6 (same XML tool calls) prefill `<think>\\n`, this "
                   "non-thinking template does not; qwen3's tool declaration is the JSON one",
    "deepseek-v4-flash": "the deepseek-v4 renderer puts '\\n\\n' before '## Tools' when there is no system "
                         "message; the V4-Flash-0731 template does not",
}


def _glm46_parallel_with_content(conv: Any) -> bool:
    return any(asst.get("content", "").strip() and len(asst.get("tool_calls") or []) > 1 for asst, *_ in conv[1])


# family -> (conversations the renderer renders unlike the template, why): left out of the
# TEMPLATE-policy draw (APPEND tolerates them: the delta is checked against the template's
# tail) and pinned by test_glm45_renderer_parallel_calls_newline
RENDER_LIMITS: dict[str, tuple[Any, str]] = {
    "glm-4.6": (_glm46_parallel_with_content,
                "renderer glm-4.5 omits the '\\n' before a 2nd+ <tool_call> when the message has content"),
}


@pytest.fixture(autouse=True)
def _pinned_today(monkeypatch: pytest.MonkeyPatch) -> None:
    """One date for the template (transformers' strftime_now) and our prompts (Llama 3:
    the codec prints the template's date, not the renderer's pinned 26 Jul 2024)."""
    import datetime as real_datetime

    from transformers.utils import chat_template_utils

    from trajectory.codec import renderers_rules

    class _Fixed(real_datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return real_datetime.datetime(2025, 3, 3, 12, 0, 0)

    monkeypatch.setattr(chat_template_utils, "datetime", _Fixed)
    monkeypatch.setattr(renderers_rules, "datetime", _Fixed)


# family -> why our own codec serves it and the renderer's contract is not run here
# (tests/fast/trajectory/test_gemma4.py runs the contract on ours; the difference is
# pinned by test_gemma4_renderer_keeps_the_prefill_the_template_drops)
OURS: dict[str, str] = {
    "gemma-4": "renderers gemma4 re-emits the disabled-thinking `<|channel>thought\\n<channel|>` prefill in "
               "history turns (a deliberate deviation, its module doc); the 31B template drops it",
}


def _params() -> list[Any]:
    out = []
    for f in RENDERER_FAMILIES:
        if f.name in OURS:
            continue
        marks = []
        if f.name in REFUSED:
            marks.append(pytest.mark.xfail(reason=REFUSED[f.name], raises=TemplateNotSupported, strict=True))
        out.append(pytest.param(f.name, id=f.name, marks=marks))
    return out


@pytest.mark.parametrize("name", _params())
def test_render_first_equals_template(load_renderer_tokenizer: Any, name: str) -> None:
    tok = load_renderer_tokenizer(name)
    codec = RenderersCodec(tok, BY_NAME[name].renderer)
    for msgs in (
        [{"role": "user", "content": "What is the weather in Paris?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    ):
        assert codec.render_first(msgs) == full_ids(tok, msgs, None)


@pytest.mark.parametrize("name", _params())
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_contract_append_policy(load_renderer_tokenizer: Any, name: str, data: Any) -> None:
    _contract(load_renderer_tokenizer, name, HistoryPolicy.APPEND, data)


@pytest.mark.parametrize("name", _params())
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_contract_template_policy(load_renderer_tokenizer: Any, name: str, data: Any) -> None:
    _contract(load_renderer_tokenizer, name, HistoryPolicy.TEMPLATE, data)


def _contract(load_renderer_tokenizer: Any, name: str, policy: HistoryPolicy, data: Any) -> None:
    fam = BY_NAME[name]
    tok = load_renderer_tokenizer(name)
    codec = RenderersCodec(tok, fam.renderer)
    conv = data.draw(conversations(name, reasoning=fam.reasoning, max_calls=fam.max_calls))
    limit = RENDER_LIMITS.get(name)
    assume(policy != HistoryPolicy.TEMPLATE or limit is None or not limit[0](conv))
    play(tok, name, conv, policy, codec=codec)


def test_bridge_refuses_assistant_append(load_renderer_tokenizer: Any) -> None:
    """renderers never re-tokenizes an assistant message: we return a typed refusal."""
    tok = load_renderer_tokenizer("qwen3.5")
    codec = RenderersCodec(tok, "qwen3.5")
    asst = {"role": "assistant", "content": "ok"}
    hist = [{"role": "user", "content": "hi"}, asst]
    res = codec.bridge(hist, codec.canonical_assistant_ids(asst), [asst])
    assert isinstance(res, BridgeRefusal)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_renderer_refused_where_template_differs(load_renderer_tokenizer: Any, name: str) -> None:
    """Template-version drift is refused at load with the probe and the differing text."""
    with pytest.raises(TemplateNotSupported) as err:
        RenderersCodec(load_renderer_tokenizer(name), BY_NAME[name].renderer)
    probe = "tool declaration" if name in ("kimi-k2-instruct", "kimi-k2-instruct-ids", "deepseek-v4-flash") else "default system prompt"
    assert probe in str(err.value) and "template" in str(err.value)


def test_minimax_identity_read_from_template(load_renderer_tokenizer: Any) -> None:
    """The renderer's default identity is MiniMax-M2.5's; the M2 template's own is used."""
    tok = load_renderer_tokenizer("minimax-m2")
    codec = RenderersCodec(tok, "minimax-m2")
    msgs = [{"role": "user", "content": "Hello"}]
    assert "You are a helpful assistant.[e~[" in tok.decode(codec.render_first(msgs))
    assert codec.render_first(msgs) == full_ids(tok, msgs, None)


def test_glm45_renderer_parallel_calls_newline(load_renderer_tokenizer: Any) -> None:
    """Pins an upstream renderer difference (renderers 0.1.12 glm-4.5 vs the GLM-4.6 template):
    with content, only the first of several tool calls gets its leading '\\n'."""
    tok = load_renderer_tokenizer("glm-4.6")
    codec = RenderersCodec(tok, "glm-4.5")
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
             for i in range(2)]
    tools_msgs = [{"role": "tool", "tool_call_id": f"c{i}", "content": "x"} for i in range(2)]
    for content, same in (("", True), ("ok", False)):
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content, "tool_calls": calls},
                *tools_msgs]
        assert (codec.render_first(msgs, tools=TOOLS) == full_ids(tok, msgs, TOOLS)) is same


def test_template_policy_sees_prefill_retokenized(load_renderer_tokenizer: Any) -> None:
    """Qwen3.5 prefills `<think>\\n`; the model samples `\\n</think>...`; the re-render
    tokenizes `<think>\\n\\n</think>`: under TEMPLATE that is a rewrite of committed
    tokens (HISTORY_REWRITE); the full render's own tokens bridge exactly."""
    tok = load_renderer_tokenizer("qwen3.5")
    codec = RenderersCodec(tok, "qwen3.5")
    user = {"role": "user", "content": "q"}
    asst = {"role": "assistant", "content": "ok",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]}
    tool = [{"role": "tool", "tool_call_id": "c0", "content": "x"}]
    sampled = codec.render_first([user], tools=TOOLS) + codec.canonical_assistant_ids(asst)
    full = full_ids(tok, [user, asst, *tool], TOOLS)
    assert full[: len(sampled)] != sampled  # the retokenized boundary
    res = codec.bridge([user, asst], sampled[-8:], tool, tools=TOOLS, policy=HistoryPolicy.TEMPLATE,
                       committed=sampled)
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.HISTORY_REWRITE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    n = full.index(end, len(codec.render_first([user], tools=TOOLS))) + 1  # the model's close
    ok = codec.bridge([user, asst], full[n - 8 : n], tool, tools=TOOLS, policy=HistoryPolicy.TEMPLATE,
                      committed=full[:n])
    assert isinstance(ok, BridgeResult) and full[:n] + ok.prompt_ids == full


def test_llama32_prompt_prints_the_template_date(load_renderer_tokenizer: Any) -> None:
    """The renderer pins 26 Jul 2024; the template prints today (pinned to 03 Mar 2025 here)."""
    tok = load_renderer_tokenizer("llama-3.2")
    codec = RenderersCodec(tok, "llama-3")
    text = tok.decode(codec.render_first([{"role": "user", "content": "Hello"}]))
    assert "Today Date: 03 Mar 2025" in text and "26 Jul 2024" not in text
    pinned = tok.decode(codec.render_first([{"role": "user", "content": "Hello"}],
                                           template_kwargs={"date_string": "26 Jul 2024"}))
    assert "Today Date: 26 Jul 2024" in pinned


def test_minimax_mid_system_append_refused_never_inexact(load_renderer_tokenizer: Any) -> None:
    """MiniMax M2: the template (and renderers' own `render_ids`) drop a system message
    past the first; renderers' `bridge_to_next_turn` renders it (`]~b]system ...`). APPEND
    refuses the step (the server answers 409) instead of committing tokens the template
    never shows; TEMPLATE follows the full render, token-exact with the template."""
    tok = load_renderer_tokenizer("minimax-m2")
    codec = RenderersCodec(tok, "minimax-m2")
    user, asst = {"role": "user", "content": "q"}, {"role": "assistant", "content": "It is sunny."}
    system = [{"role": "system", "content": "Answer in one word."}]
    committed = codec.render_first([user]) + codec.canonical_assistant_ids(asst)
    full = full_ids(tok, [user, asst, *system], None)
    assert "Answer in one word" not in tok.decode(full)  # the template drops it
    res = codec.bridge([user, asst], committed[-8:], system, policy=HistoryPolicy.APPEND)
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.NOT_APPEND_ONLY
    assert "unlike its own full render" in res.detail
    # TEMPLATE: the committed ids as the template renders them (reasoning kept: no user follows)
    thought = {**asst, "reasoning_content": "Sun."}
    full = full_ids(tok, [user, thought, *system], None)
    done = full[: full.index(tok.convert_tokens_to_ids("[e~["), len(codec.render_first([user]))) + 1]
    ok = codec.bridge([user, thought], done[-8:], system, policy=HistoryPolicy.TEMPLATE, committed=done)
    assert isinstance(ok, BridgeResult) and done + ok.prompt_ids == full
    # a user append still bridges exactly (the check costs nothing where they agree)
    more = [{"role": "user", "content": "And tomorrow?"}]
    got = codec.bridge([user, asst], committed[-8:], more, policy=HistoryPolicy.APPEND)
    assert isinstance(got, BridgeResult) and full_ids(tok, [user, asst, *more], None)[-len(got.prompt_ids):] == got.prompt_ids


@pytest.mark.parametrize("policy", [HistoryPolicy.APPEND, HistoryPolicy.TEMPLATE])
def test_glm_renderer_sampled_observation_then_user_refuses_role_mismatch(
    load_renderer_tokenizer: Any, policy: HistoryPolicy
) -> None:
    """The same rule as our template codec (base.py): the model sampled `<|observation|>`,
    the agent answers with a user message; no delta after it is the template's, so the
    bridge refuses ROLE_MISMATCH (never `<|observation|><|user|>`) under either policy."""
    tok = load_renderer_tokenizer("glm-4.6")
    codec = RenderersCodec(tok, "glm-4.5")
    user = {"role": "user", "content": "q"}
    asst = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]}
    committed = codec.render_first([user], tools=TOOLS) + codec.canonical_assistant_ids(asst)
    assert tok.convert_ids_to_tokens(committed[-1]) == "<|observation|>"
    res = codec.bridge([user, asst], committed[-8:], [{"role": "user", "content": "Never mind."}], tools=TOOLS,
                       policy=policy, committed=committed)
    assert isinstance(res, BridgeRefusal) and res.reason == RefusalReason.ROLE_MISMATCH
    assert "<|observation|>" in res.detail and "<|user|>" in res.detail
