"""Every codec of the family registry (`families.known_names()`, plus the `renderers`
codec of each name ours also serve) parses sampled text by the same rules:

(a) text is decoded exactly: a tokenizer whose config turns clean-up on (the real
    Llama 3.2 one does) still gives `print(a , b)` and `it 's` back as sampled;
(b) a call to a tool the request did not offer is not a call: where the format has
    tool-call markup it is a parse failure (INVALID_FORMAT, the markup kept visible);
    where it has none (Llama 3.x: the whole reply is the call's JSON), the reply is a
    JSON answer, kept verbatim as content;
(c) arguments that are not a JSON object (`"Paris"`, `[1, 2]`) are INVALID_JSON and no
    call: no client dialect can carry them (Anthropic's `tool_use.input` is an object).

Each family's sampled ids are its own canonical rendering of an assistant message
(`canonical_assistant_ids`: what a model sampling that message emits), edited as text
where a rule needs another reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from session_server.sim.tokenizers import build_template_tokenizer, build_tokenizer
from tests.fast.trajectory.renderer_families import BY_NAME, GPT_OSS, build
from trajectory.codec import ToolCallParseStatus, codec_for, decode_text
from trajectory.codec.detect import RENDERERS_PREFIX, Detection
from trajectory.codec.families import known_names, ours, renderer_names
from trajectory.codec.renderers_codec import RenderersCodec

EXACT = "print(a , b) it 's fine ."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
# the id as Kimi K2 samples it (`functions.NAME:IDX`, its template renders the id); other
# templates do not render it
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}

# families whose tool calls carry no markup: a call to another name is a JSON answer
BARE_JSON = {"llama3.1", "llama-3"}
# families without tool calls at all: every reply is content
NO_TOOL_CALLS = {"llama3": "the plain Llama 3 template renders no tool calls (Llama3Codec keeps all text as content)"}
# families whose argument grammar can only write an object (key/value pairs): (c) has no
# reply to test there; checked below by the rendering holding no JSON object
OBJECT_GRAMMAR = {
    "glm4moe": "<arg_key>/<arg_value> pairs", "glm-4.5": "<arg_key>/<arg_value> pairs",
    "glm-5": "<arg_key>/<arg_value> pairs", "glm-5.1": "<arg_key>/<arg_value> pairs",
    "glm-5.3": "<arg_key>/<arg_value> pairs", "hy3": "<arg_key>/<arg_value> pairs",
    "gemma4": "call:NAME{key:value}", "renderers:gemma4": "call:NAME{key:value}",
    "prime-qwen3": "<parameter=...> blocks", "qwen3.5": "<parameter=...> blocks", "qwen3.6": "<parameter=...> blocks", "qwen3.8": "<parameter=...> blocks",
    "nemotron-3": "<parameter=...> blocks", "nemotron-3.5": "<parameter=...> blocks",
    "minimax-m2": "<parameter name=...> blocks", "generic": "<parameter=...> blocks (Qwen3-Coder)",
    "deepseek-v4": "DSML <parameter> blocks", "laguna-xs.2": "<arg_key>/<arg_value> pairs",
    "laguna-xs-2.1": "<arg_key>/<arg_value> pairs", "laguna-s-2.1": "<arg_key>/<arg_value> pairs",
}
# renderers families no offline tokenizer can build
UNBUILT = {"gpt-oss": "renderers' gpt-oss renderer downloads openai-harmony's vocabulary (no network in tests); "
                      "gpt-oss templates are served by our HarmonyCodec (the `harmony` family, tested here)"}

# renderers families without a template in our test data: a tokenizer declaring the special
# tokens the renderer looks up (its constructor asserts each one), with a stand-in template
_KIMI25 = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
           "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_begin|>", "<|media_content|>",
           "<|media_pad|>", "<|media_end|>", "<think>", "</think>")
_HY3 = tuple(f"<\uff5c{n}:opensource\uff5c>" for n in ("hy_begin_of_sentence", "hy_eos", "hy_User",
                                                          "hy_Assistant", "reasoning_mode")) + tuple(
    f"<{n}:opensource>" for n in ("think", "/think", "tool_calls", "/tool_calls", "tool_call", "/tool_call",
                                  "tool_sep", "arg_key", "/arg_key", "arg_value", "/arg_value", "tool_responses",
                                  "/tool_responses", "tool_response", "/tool_response"))
_LAGUNA = ("\u3008|EOS|\u3009", "<think>", "</think>", "<assistant>", "</assistant>", "<tool_call>", "</tool_call>")
STAND_INS = {"kimi-k2.5": (_KIMI25, "<|im_end|>"), "hy3": (_HY3, _HY3[1]), "laguna-xs.2": (_LAGUNA, _LAGUNA[0]),
             "laguna-xs-2.1": (_LAGUNA, _LAGUNA[0]), "laguna-s-2.1": (_LAGUNA, _LAGUNA[0])}

# family -> the test tokenizer serving it: ours (sim), a renderer_families entry, or a stand-in
TOKENIZER: dict[str, str] = {
    "qwen3": "sim:qwen3", "llama3": "sim:llama3", "llama3.1": "sim:llama3.1", "glm4moe": "sim:glm4moe",
    "gemma4": "gemma-4", "deepseek": "deepseek-v3.1", "kimi-k2": "kimi-k2-instruct-ids", "harmony": "gpt-oss",
    "generic": "qwen3-coder",
    "renderers:qwen3": "qwen3-r", "prime-qwen3": "qwen3-r", "qwen3.5": "qwen3.5", "qwen3.6": "qwen3.5",
    "qwen3.8": "qwen3.5", "glm-4.5": "glm-4.6", "glm-5": "glm-4.7", "glm-5.1": "glm-4.7", "glm-5.3": "glm-4.7",
    "minimax-m2": "minimax-m2", "deepseek-v3": "deepseek-v3.1", "deepseek-r1": "deepseek-v3.1",
    "deepseek-v4": "deepseek-v4-flash", "renderers:kimi-k2": "kimi-k2-instruct-ids", "nemotron-3": "nemotron-3-nano",
    "nemotron-3.5": "nemotron-3-nano", "llama-3": "llama-3.2", "renderers:gemma4": "gemma-4",
    **{name: f"stand-in:{name}" for name in STAND_INS},
}


def _families() -> list[str]:
    """Every name the registry serves, and the renderers codec of each name ours serve."""
    ours_too = [f"{RENDERERS_PREFIX}{n}" for n in renderer_names() if ours(n) is not None]
    return [*known_names(), *ours_too]


FAMILIES = _families()


def test_every_registered_family_is_in_this_suite() -> None:
    """A family added to the registry must be added here (its tokenizer), or it escapes the rules."""
    assert sorted(set(FAMILIES) - set(TOKENIZER) - set(UNBUILT)) == []


def _cleanup_on(path: Path) -> Path:
    """Turn clean-up on in the tokenizer's config, as the real Llama 3.2 tokenizer does
    (transformers 5 ignores it for BPE unless the second key forces it: both majors clean)."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["clean_up_tokenization_spaces"] = True
    cfg["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    cfg_path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def codec_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("parse-rules")
    toks: dict[str, Any] = {}

    def tokenizer(key: str) -> Any:
        if key not in toks:
            out = root / key.replace(":", "_").replace(".", "_")
            if key.startswith("sim:"):
                path = build_tokenizer(key.removeprefix("sim:"), out)
            elif key.startswith("stand-in:"):
                specials, eos = STAND_INS[key.removeprefix("stand-in:")]
                path = build_template_tokenizer(out, "{{ messages }}", specials, eos=eos)
            else:
                path = build(GPT_OSS if key == "gpt-oss" else BY_NAME[key], out)
            toks[key] = AutoTokenizer.from_pretrained(str(_cleanup_on(path)))
        return toks[key]

    def make(family: str) -> Any:
        tok = tokenizer(TOKENIZER[family])
        name = family.removeprefix(RENDERERS_PREFIX)
        if family.startswith(RENDERERS_PREFIX) or _served_by_renderers(family):
            # load-time verification compares prompts with the template; parsing does not
            # depend on it (several test tokenizers carry another version's template)
            return RenderersCodec(tok, name, verify=False)
        return codec_for(tok, Detection(family, "forced", "test"))

    return make


def _served_by_renderers(family: str) -> bool:
    return family in renderer_names() and ours(family) is None


def _params() -> list[Any]:
    return [pytest.param(f, id=f, marks=[pytest.mark.skip(reason=UNBUILT[f])] if f in UNBUILT else [])
            for f in FAMILIES]


def _sampled(codec: Any, message: dict[str, Any]) -> list[int]:
    """What a model sampling `message` emits (the family's canonical ids, stop token
    included). Where the generation prompt leaves `<think>` open and the render of a
    message without reasoning never closes it (MiniMax M2, DeepSeek R1), the model
    closes it first: `</think>` leads (the codec's own rule, `_close_reasoning`)."""
    ids = list(codec.canonical_assistant_ids(message))
    tok = codec.tokenizer
    if decode_text(tok, codec.generation_prompt_ids).rstrip().endswith("<think>") and \
            "</think>" not in decode_text(tok, ids):
        ids = list(tok.encode("</think>", add_special_tokens=False)) + ids
    return ids


@pytest.mark.parametrize("family", _params())
def test_decoding_never_cleans_up_text(codec_of: Callable[[str], Any], family: str) -> None:
    codec = codec_of(family)
    tok = codec.tokenizer
    plain = list(tok.encode(EXACT, add_special_tokens=False))
    assert tok.decode(plain) != EXACT, "precondition: this tokenizer's own decode cleans up spaces"
    ids = _sampled(codec, {"role": "assistant", "content": EXACT})
    for tools in (None, [WEATHER]):
        parsed = codec.parse_assistant(ids, tools=tools)
        # the edges are the template's (it trims content, writes "\n" around it): clean-up
        # is inside the text, where it drops the spaces before punctuation
        assert (parsed.content or "").strip() == EXACT, (family, tools, parsed)
        assert parsed.status == ToolCallParseStatus.OK and not parsed.tool_calls


def _call_ids(codec: Any, family: str) -> list[int]:
    """A call to get_weather({"city": "Paris"}) as the family samples it; its parse with
    the tool offered must be that call (else the other rules would test nothing)."""
    ids = _sampled(codec, CALL)
    parsed = codec.parse_assistant(ids, tools=[WEATHER])
    if family in NO_TOOL_CALLS:
        assert not parsed.tool_calls, NO_TOOL_CALLS[family]
        pytest.skip(NO_TOOL_CALLS[family])
    assert parsed.status == ToolCallParseStatus.OK, (family, parsed)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    return ids


@pytest.mark.parametrize("family", _params())
def test_a_call_to_a_tool_not_offered_is_not_a_call(codec_of: Callable[[str], Any], family: str) -> None:
    codec = codec_of(family)
    ids = _call_ids(codec, family)
    parsed = codec.parse_assistant(ids, tools=[SEARCH])
    assert parsed.tool_calls == [], (family, parsed)
    if family.removeprefix(RENDERERS_PREFIX) in BARE_JSON:  # no markup: a JSON answer, verbatim
        cut = next((i for i, t in enumerate(ids) if t in codec.stop_token_ids), len(ids))
        assert parsed.status == ToolCallParseStatus.OK
        assert parsed.content == decode_text(codec.tokenizer, ids[:cut])
    else:
        assert parsed.status == ToolCallParseStatus.INVALID_FORMAT, (family, parsed)
        assert "get_weather" in parsed.status_detail


_OBJECTS = ('{"city": "Paris"}', '{"city":"Paris"}')


@pytest.mark.parametrize("bad", ['"Paris"', "[1, 2]", "42"])
@pytest.mark.parametrize("family", _params())
def test_arguments_that_are_not_an_object_are_a_parse_failure(
    codec_of: Callable[[str], Any], family: str, bad: str
) -> None:
    codec = codec_of(family)
    ids = _call_ids(codec, family)
    text = decode_text(codec.tokenizer, ids)
    found = [o for o in _OBJECTS if o in text]
    if family in OBJECT_GRAMMAR:
        assert not found, f"{family} writes JSON arguments: remove it from OBJECT_GRAMMAR"
        pytest.skip(f"arguments are {OBJECT_GRAMMAR[family]}: only an object can be written")
    assert found, (family, text)
    edited = list(codec.tokenizer.encode(text.replace(found[0], bad, 1), add_special_tokens=False))
    parsed = codec.parse_assistant(edited, tools=[WEATHER])
    assert parsed.tool_calls == [], (family, parsed)
    assert parsed.status == ToolCallParseStatus.INVALID_JSON, (family, parsed)


def test_the_real_llama_3_2_tokenizer_and_template_keep_every_rule(tmp_path: Path) -> None:
    """The defect as reported: the real Llama 3.2 tokenizer (clean-up on in its own
    config) with its own template, detected and served as `llama-3`: exact text, a JSON
    answer that names no offered tool is text, string arguments are INVALID_JSON."""
    from transformers import AutoTokenizer

    from tests.fast.real_tokenizers import real_tokenizer_dir
    from trajectory.codec import load_codec

    path = real_tokenizer_dir("llama-3.2-real", tmp_path / "llama-3.2")
    assert json.loads((path / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is True
    codec = load_codec(str(path))
    assert codec.family == "llama-3", codec.family
    tok = AutoTokenizer.from_pretrained(str(path))
    eot = tok.convert_tokens_to_ids("<|eot_id|>")

    def parse(text: str) -> Any:
        return codec.parse_assistant([*tok.encode(text, add_special_tokens=False), eot], tools=[WEATHER])

    exact = parse(EXACT)
    assert exact.content == EXACT and exact.tool_calls == []
    alice = parse('{"name": "Alice", "age": 30}')
    assert alice.tool_calls == [] and alice.content == '{"name": "Alice", "age": 30}'
    paris = parse('{"name": "get_weather", "parameters": "Paris"}')
    assert paris.status == ToolCallParseStatus.INVALID_JSON and paris.tool_calls == []
