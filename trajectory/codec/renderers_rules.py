"""Our rules over a `renderers` renderer (`renderers_codec.py` serves it).

Parsing keeps our rules, whatever the renderer's parser accepts (every codec keeps
them; tests/fast/trajectory/test_every_codec_parses_by_one_rule.py checks each family):

- text is decoded exactly: the renderer is handed `ExactDecode(tokenizer)`, whose
  `decode` always turns `clean_up_tokenization_spaces` off (the real Llama 3.2
  tokenizer turns it on: `print(a , b)` would come back `print(a, b)`);
- only the request's tool names are calls (`tool_names`): another name is a parse
  status (the call's markup stays visible in the turn record), as our markup
  parsers do;
- arguments are a JSON object (or a string holding one): anything else
  (`"parameters": "Paris"`) is INVALID_JSON, never a call whose arguments no
  client dialect can carry (Anthropic's `tool_use.input` is an object);
- Llama 3 (`llama-3`) has no tool-call markup: the whole reply is
  `{"name": ..., "parameters": {...}}`, the grammar of our Llama 3.1 codec, so the
  exactly decoded reply is parsed by `parse_llama31` itself: a JSON *answer* that
  names no offered tool (`{"name": "Alice", "age": 30}`) is content, kept verbatim.

Load-time checks (prefer the tokenizer's template, the truth of what the model was
trained with): the renderer's prompts must equal the template's on probe
conversations (default system prompt, explicit system, tool declaration), else
TemplateNotSupported names the first difference (template-version drift: Kimi K2's
older templates). Where the renderer has a knob for it, it is set from the
template instead: MiniMax's `model_identity` (its default system prompt) and
Llama 3's `date_string` (prompts print the template's date, not the renderer's
pinned 26 Jul 2024; APPEND's comparison renders keep the pin).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from trajectory.codec.base import Message, ParsedAssistant, ParsedToolCall, ToolCallParseStatus
from trajectory.codec.parsing import new_call_id, tool_names
from trajectory.codec.probe import decode_text, encode, render_text
from trajectory.codec.xml_args import xml_arguments

__all__ = ["ExactDecode", "dated_kwargs", "object_arguments", "template_identity", "template_difference", "to_parsed_assistant", "today"]


class ExactDecode:
    """The tokenizer as the renderer sees it: every `decode` with
    `clean_up_tokenization_spaces` off (`probe.decode_text`'s rule), everything else
    the tokenizer's own. The renderer's parsers call `tokenizer.decode(ids,
    skip_special_tokens=False)`, which honours a config that turns clean-up on (the
    real Llama 3.2 tokenizer's: `it 's` -> `it's`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["clean_up_tokenization_spaces"] = False
        return self._tokenizer.decode(ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)


class _RendersFirst(Protocol):
    """What the load-time check needs of a codec: its tokenizer and its first prompt."""

    tokenizer: Any

    def render_first(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None,
                     template_kwargs: Mapping[str, Any] | None = None) -> list[int]: ...


# probe conversations whose prompt must equal the template's (verify at load): the
# default system prompt, an explicit one, and the tool declaration
_VERIFY_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
_VERIFY: tuple[tuple[str, list[Message], Any], ...] = (
    ("default system prompt", [{"role": "user", "content": "Hello"}], None),
    ("system prompt", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], None),
    ("tool declaration", [{"role": "user", "content": "Hello"}], _VERIFY_TOOLS),
)


def template_difference(codec: _RendersFirst) -> str | None:
    """The first probe (default system prompt, explicit system, tools) whose prompt
    the renderer renders unlike the tokenizer's template, with the differing text;
    None when all are token-identical. Tells template-version drift (another default
    system prompt, another tool-JSON layout) from a working renderer at load."""
    tok = codec.tokenizer
    for what, msgs, tools in _VERIFY:
        try:
            want = encode(tok, render_text(tok, msgs, tools=tools, add_generation_prompt=True))
        except Exception:
            continue  # the template cannot render this probe: nothing to compare
        try:
            got = codec.render_first(msgs, tools=tools)
        except Exception as exc:
            return f"{what}: renderer raised {exc}"
        if got != want:
            k = next((i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y),
                     min(len(got), len(want)))
            return (f"{what} differs at token {k}: renderer {decode_text(tok, got[k:k + 12])!r}, "
                    f"template {decode_text(tok, want[k:k + 12])!r}")
    return None


def template_identity(tokenizer: Any, config_fields: Mapping[str, Any]) -> dict[str, Any]:
    """Config overrides that make the renderer print the template's own default
    system prompt: renderers ships one identity per family (MiniMax: the M2.5
    one) while each template version prints its own (MiniMax-M2: "You are a
    helpful assistant."). Read from the template: its render of [user] against
    [system MARK, user]; {} when the renderer's config (`config_fields`) has no such
    knob or the template prints no default."""
    if "model_identity" not in config_fields or not getattr(tokenizer, "chat_template", None):
        return {}
    mark, user = "\u2063MARK\u2063", {"role": "user", "content": "Go."}
    try:
        with_sys = render_text(tokenizer, [{"role": "system", "content": mark}, user], add_generation_prompt=False)
        bare = render_text(tokenizer, [user], add_generation_prompt=False)
    except Exception:
        return {}
    head, _, rest = with_sys.partition(mark)
    if not rest or not bare.startswith(head) or not bare.endswith(rest) or len(bare) < len(head) + len(rest):
        return {}
    identity = bare[len(head): len(bare) - len(rest)]
    return {"model_identity": identity} if identity else {}


def dated_kwargs(kw: Mapping[str, Any] | None, dated: bool) -> Mapping[str, Any] | None:
    """Kwargs for a prompt the model sees: the template's own date where it prints
    one (`dated`; `strftime_now("%d %b %Y")`, as transformers renders it) unless the
    caller pinned `date_string`."""
    if not dated or (kw and "date_string" in kw):
        return kw
    return {**dict(kw or {}), "date_string": today()}


def today() -> str:
    """Today's date as chat templates print it (transformers' `strftime_now`)."""
    return datetime.now().strftime("%d %b %Y")


def to_parsed_assistant(parsed: Any, *, tools_offered: bool,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedAssistant:
    """Their `ParsedResponse` as our `ParsedAssistant` (ids for calls without one),
    with our rules (module doc): a call names an offered tool, its arguments are a
    JSON object; else the turn's status says why and the call is dropped.

    A `<function=...><parameter=...>` call they flag `invalid_json` is read again with
    the template's own value rule (`xml_args`: `True`/`None`, plain strings)."""
    names = tool_names(tools)
    calls: list[ParsedToolCall] = []
    status, detail = ToolCallParseStatus.OK, ""

    def fail(st: ToolCallParseStatus, why: str) -> None:
        nonlocal status, detail
        status, detail = st, why

    for tc in parsed.tool_calls:
        st = str(getattr(tc.status, "value", tc.status))
        if tools_offered and tc.name and tc.name not in names:
            # before their status: a renderer that types arguments by the tool's schema
            # (MiniMax, Hy3, Laguna) calls an unknown tool's arguments invalid_json
            fail(ToolCallParseStatus.INVALID_FORMAT,
                 f"tool call names {tc.name!r}, not one of the request's tools {sorted(names)}")
            continue
        again = xml_arguments(tc.raw, tools) if st == "invalid_json" and "<parameter=" in (tc.raw or "") else None
        args: dict[str, Any] | None
        if again is not None:
            name, args = again[0], again[1]
        elif st != "ok":
            fail(ToolCallParseStatus.INVALID_JSON if st == "invalid_json" else ToolCallParseStatus.INVALID_FORMAT,
                 f"{st}: {(tc.raw or '')[:200]}")
            continue
        else:
            name, args = tc.name or "", object_arguments(tc.arguments)
        if tools_offered and name not in names:
            fail(ToolCallParseStatus.INVALID_FORMAT,
                 f"tool call names {name!r}, not one of the request's tools {sorted(names)}")
            continue
        if args is None:
            fail(ToolCallParseStatus.INVALID_JSON, f"tool call arguments are not a JSON object: {(tc.raw or '')[:200]}")
            continue
        calls.append(ParsedToolCall(id=tc.id or new_call_id(), name=name, arguments=json.dumps(args, ensure_ascii=False)))
    if not tools_offered and (calls or status is not ToolCallParseStatus.OK):
        # no tools offered: any call is the model's mistake, kept visible as a status
        return ParsedAssistant(
            content=parsed.content, reasoning_content=parsed.reasoning_content,
            status=ToolCallParseStatus.INVALID_FORMAT, status_detail="tool call markup but no tools offered",
        )
    return ParsedAssistant(
        content=parsed.content,
        reasoning_content=parsed.reasoning_content or None,
        tool_calls=calls,
        status=status,
        status_detail=detail,
    )


def object_arguments(arguments: Any) -> dict[str, Any] | None:
    """A parsed call's arguments as the JSON object a client receives: an object, a
    string holding one, or none at all (`{}`: a call of no arguments); None for
    anything else (`"Paris"`, a list, a number): no client dialect can carry it."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None
