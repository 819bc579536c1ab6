"""Checking a chat template against our codec contract (`session-server verify-template`).

Owns the verifier anyone can run on a tokenizer before training with it: probe
conversations (user, tool, parallel-tool, system and client-injected assistant
appends; reasoning on and off; unicode; JSON arguments with true/false/null) are
played turn by turn exactly as the server plays them (`render_first`, canonical
sampling, `close_turn`, `bridge`), and every step is compared with the
tokenizer's own full chat-template render:

- append-only: the full render of history + new starts with the full render of
  the history (as text), i.e. the template never rewrites committed turns here;
- bridge: on an append-only step, committed + bridged ids must equal the full
  render token for token (else a *hard mismatch*, with the first differing token
  and decoded context); a typed refusal there is a *warning* (the server refuses
  a step it could take), and on a step that is not append-only a refusal or a
  flagged rewrite is reported, never a failure;
- parse: every probe assistant message survives canonical ids -> parse_assistant.

Pure library (no session_server import); the CLI only formats `VerifyReport`
(`trajectory.codec.verify_report`, the report types).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trajectory.codec.base import BridgeRefusal, ChatCodec, HistoryPolicy, Message
from trajectory.codec.probe import decode_text, encode, render_text
from trajectory.codec.verify_report import FirstDifference, ParseReport, StepReport, VerifyReport
from trajectory.errors import CodecError

THINKING_MODES = ("on", "off", "both")
CONTEXT_TOKENS = 4  # decoded tokens shown on each side of a first difference

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "metric": {"type": "boolean"},
                    "detailed": {"type": "boolean"},
                    "date": {"type": ["string", "null"]},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]


# -- probe conversations ----------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A prefix, then (assistant message, messages appended after it) per turn."""

    name: str
    prefix: tuple[Message, ...]
    turns: tuple[tuple[Message, tuple[Message, ...]], ...]
    tools: bool = False


def _call(i: str, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def scenarios(*, reasoning: bool) -> list[Scenario]:
    """The probe conversations; assistant turns carry reasoning when `reasoning`."""

    def asst(content: str, calls: Sequence[dict[str, Any]] = (), think: str = "Let me think.") -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = think
        if calls:
            msg["tool_calls"] = list(calls)
        return msg

    system = {"role": "system", "content": "You are a careful assistant."}
    user = {"role": "user", "content": "What is the weather in Paris?"}
    json_call = _call("w1", "get_weather", {"city": "Paris", "metric": True, "detailed": False,
                                            "date": None, "days": 3})
    par = [_call("p1", "get_weather", {"city": "Paris"}), _call("p2", "search", {"q": "Paris events"})]
    return [
        Scenario("user_append", (system, user), (
            (asst("It is sunny."), ({"role": "user", "content": "And tomorrow?"},)),
            (asst("Rain is likely."), ({"role": "user", "content": "Thanks."},)),
        )),
        Scenario("tool_append_json", (system, user), (
            (asst("", [json_call]), ({"role": "tool", "tool_call_id": "call_w1",
                                      "content": '{"temp": 21, "rain": false, "wind": null}'},)),
            (asst("It is 21 degrees and dry."), ({"role": "user", "content": "Great."},)),
        ), tools=True),
        Scenario("parallel_tool_calls", (user,), (
            (asst("Checking both.", par), (
                {"role": "tool", "tool_call_id": "call_p1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_p2", "content": "a concert"},
            )),
        ), tools=True),
        Scenario("system_append", (system, user), (
            (asst("It is sunny."), ({"role": "system", "content": "Answer in one word."},)),
        )),
        Scenario("assistant_append", (system, user), (
            (asst("It is sunny."), ({"role": "assistant", "content": "Anything else?"},)),
        )),
        Scenario("unicode", (system, {"role": "user", "content": "Größe von 東京? ¿Qué tal? 🌧️"}), (
            (asst("東京 ist groß — très grand ☔ «oui»", think="Überlegen: 東京…"),
             ({"role": "user", "content": "Ça va? 👍🏽 naïve café"},)),
        )),
    ]


def with_call_ids(sc: Scenario, call_id: Callable[[str, int], str]) -> Scenario:
    """`sc` with its tool-call ids in the family's own format (`call_id(name, n)`, n counting
    the scenario's calls), tool results following: a template that renders ids (Kimi's
    `functions.NAME:IDX`) then renders what its model samples, which the parse reads back."""
    renames: dict[str, str] = {}

    def rename(msg: Message) -> Message:
        if msg.get("tool_calls"):
            calls = []
            for tc in msg["tool_calls"]:
                renames[tc["id"]] = call_id(tc["function"]["name"], len(renames))
                calls.append({**tc, "id": renames[tc["id"]]})
            return {**msg, "tool_calls": calls}
        if msg.get("role") == "tool" and msg.get("tool_call_id") in renames:
            return {**msg, "tool_call_id": renames[msg["tool_call_id"]]}
        return msg

    turns = tuple((rename(a), tuple(rename(m) for m in new)) for a, new in sc.turns)
    return Scenario(sc.name, sc.prefix, turns, sc.tools)


# -- the checks -------------------------------------------------------------------


def first_difference(tokenizer: Any, expected: Sequence[int], got: Sequence[int],
                     context: int = CONTEXT_TOKENS) -> FirstDifference | None:
    """None when equal; else the first index where they differ and decoded context."""
    if list(expected) == list(got):
        return None
    i = next((k for k, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
             min(len(expected), len(got)))

    def window(ids: Sequence[int]) -> str:
        lo = max(0, i - context)
        before = decode_text(tokenizer, ids[lo:i])
        after = decode_text(tokenizer, ids[i : i + context])
        return f"{before!r} | {after!r} (ids {list(ids[i : i + context])})"

    return FirstDifference(i, len(expected), len(got), window(expected), window(got))


def _accepts_kwargs(fn: Any) -> bool:
    try:
        return "template_kwargs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _canonical(codec: ChatCodec, msg: Message, kw: Mapping[str, Any] | None) -> list[int]:
    fn = codec.canonical_assistant_ids
    return list(fn(msg, template_kwargs=kw) if _accepts_kwargs(fn) else fn(msg))  # type: ignore[call-arg]


def _full_ids(tokenizer: Any, messages: Sequence[Message], tools: Any, kw: Any) -> list[int]:
    return encode(tokenizer, render_text(tokenizer, messages, tools=tools, add_generation_prompt=True,
                                         template_kwargs=kw))


def _expected_message(msg: Message) -> dict[str, Any]:
    """The parts of an assistant message a parse must give back (call ids are fresh)."""
    return {
        "content": msg.get("content") or "",
        "reasoning_content": msg.get("reasoning_content") or None,
        "tool_calls": [
            {"name": tc["function"]["name"], "arguments": json.loads(tc["function"]["arguments"])}
            for tc in msg.get("tool_calls") or ()
        ],
    }


def _parsed_message(parsed: Any) -> dict[str, Any]:
    calls = []
    for tc in parsed.tool_calls:
        try:
            args = json.loads(tc.arguments)
        except ValueError:
            args = tc.arguments
        calls.append({"name": tc.name, "arguments": args})
    return {"content": parsed.content or "", "reasoning_content": parsed.reasoning_content or None,
            "tool_calls": calls}


def check_parse(codec: ChatCodec, tokenizer: Any, scenario: str, thinking: str, msg: Message,
                tools: Any, kw: Mapping[str, Any] | None) -> ParseReport:
    """canonical_assistant_ids -> parse_assistant must give `msg` back."""
    try:
        ids = _canonical(codec, msg, kw)
    except CodecError as exc:
        return ParseReport(scenario, thinking, None, f"template cannot render it: {exc}")
    missing = [tc["function"]["name"] for tc in msg.get("tool_calls") or ()
               if tc["function"]["name"] not in decode_text(tokenizer, ids)]
    if missing:
        return ParseReport(scenario, thinking, None, f"template does not render tool calls ({missing[0]})")
    parsed = codec.parse_assistant(ids, tools=tools, template_kwargs=kw)
    want, got = _expected_message(msg), _parsed_message(parsed)
    if want == got and parsed.status == "ok":
        return ParseReport(scenario, thinking, True)
    diff = [k for k in want if want[k] != got[k]]
    detail = f"parse gives back a different message ({', '.join(diff) or 'status'}: " \
             f"expected {json.dumps({k: want[k] for k in diff}, ensure_ascii=False)}, " \
             f"got {json.dumps({k: got[k] for k in diff}, ensure_ascii=False)}; status {parsed.status}" \
             f"{' ' + parsed.status_detail if parsed.status_detail else ''})"
    return ParseReport(scenario, thinking, False, detail, want, got)


def play_scenario(codec: ChatCodec, tokenizer: Any, sc: Scenario, thinking: str,
                  kw: Mapping[str, Any] | None) -> tuple[list[StepReport], list[ParseReport]]:
    """Play `sc` as the server does; report each bridged step and each parse."""
    tools = TOOLS if sc.tools else None
    steps: list[StepReport] = []
    msgs: list[Message] = list(sc.prefix)
    parses = [check_parse(codec, tokenizer, sc.name, thinking, asst, tools, kw) for asst, _ in sc.turns]
    try:
        ids = codec.render_first(msgs, tools=tools, template_kwargs=kw)
    except CodecError as exc:
        steps.append(StepReport(sc.name, 0, thinking, ("first",), None, "unsupported",
                                f"render_first failed: {exc}"))
        return steps, parses
    for n, (asst, new) in enumerate(sc.turns):
        roles = tuple(str(m["role"]) for m in new)
        step = _step(codec, tokenizer, sc.name, n, thinking, roles, msgs, ids, asst, list(new), tools, kw)
        steps.append(step.report)
        if step.next_ids is None:
            break
        ids, msgs = step.next_ids, [*msgs, asst, *new]
    return steps, parses


@dataclass(frozen=True)
class _Step:
    report: StepReport
    next_ids: list[int] | None  # what the branch holds after the step (None: stop here)


def _step(codec: ChatCodec, tok: Any, name: str, n: int, thinking: str, roles: tuple[str, ...],
          msgs: list[Message], ids: list[int], asst: Message, new: list[Message],
          tools: Any, kw: Mapping[str, Any] | None) -> _Step:
    """One turn: sample canonically, close, bridge; compare with the full render."""

    def report(append_only: bool | None, outcome: str, detail: str = "",
               diff: FirstDifference | None = None) -> StepReport:
        return StepReport(name, n, thinking, roles, append_only, outcome, detail, diff)

    history = [*msgs, asst]
    # the template's own field names (gpt-oss reads reasoning from `thinking`)
    form = getattr(codec, "template_messages", list)
    try:
        sampled = _canonical(codec, asst, kw)
        before = render_text(tok, form(history), tools=tools, add_generation_prompt=False, template_kwargs=kw)
        after = render_text(tok, form(history + new), tools=tools, add_generation_prompt=True, template_kwargs=kw)
        full = _full_ids(tok, form(history + new), tools, kw)
    except Exception as exc:  # the template itself cannot render this conversation
        return _Step(report(None, "unsupported", f"template cannot render this step: {exc}"), None)
    committed = ids + sampled + codec.close_turn(sampled)
    text_append_only = after.startswith(before)
    # append-only for the branch: the template keeps every committed token, including a
    # stop token the model sampled (GLM `<|user|>` before a system turn is not kept)
    append_only = text_append_only and full[: len(committed)] == committed
    res = codec.bridge(history, committed[-8:], new, tools=tools, template_kwargs=kw,
                       policy=HistoryPolicy.APPEND)
    if isinstance(res, BridgeRefusal):
        detail = f"BridgeRefusal({res.reason.value}): {res.detail}"
        if append_only:
            detail += " (the template is append-only here: the server refuses a step it could take)"
        return _Step(report(append_only, "refused", detail), full)
    got = committed + list(res.prompt_ids)
    diff = first_difference(tok, full, got)
    if append_only:
        if diff is None:
            return _Step(report(True, "exact"), got)
        return _Step(report(True, "mismatch", "bridge != full template render: " + diff.describe(), diff), full)
    why = ("the template re-renders earlier turns here" if not text_append_only else
           "the committed tokens (with the sampled stop token) are not a prefix of the full render")
    tail_ok = bool(res.prompt_ids) and full[-len(res.prompt_ids):] == list(res.prompt_ids)
    detail = (f"{why}; committed tokens are kept"
              f"{'' if res.rewrites_history else ' (not flagged by the bridge)'}; "
              f"new tokens {'equal' if tail_ok else 'differ from'} the full render's tail")
    return _Step(report(False, "rewrite", detail, diff), full)


def thinking_plan(tokenizer: Any, mode: str, codec: ChatCodec | None = None,
                  ) -> tuple[bool, list[tuple[str, dict[str, Any] | None]]]:
    """(template has the switch, [(label, template_kwargs)]) for `--thinking MODE`.

    A codec may name its template's own switch (`thinking_switch`: gpt-oss has no
    `enable_thinking`; "on" is its highest reasoning effort with reasoning in every
    turn, "off" its lowest with none, since it cannot stop reasoning)."""
    if mode not in THINKING_MODES:
        raise ValueError(f"thinking must be one of {THINKING_MODES}, not {mode!r}")
    template = str(getattr(tokenizer, "chat_template", "") or "")
    own = getattr(codec, "thinking_switch", None)
    if own is None and "enable_thinking" not in template:
        return False, [("default", None)]
    plan: dict[str, list[tuple[str, dict[str, Any] | None]]] = {
        "on": [("on", {"enable_thinking": True})], "off": [("off", {"enable_thinking": False})]}
    if own is not None:
        plan = {label: [(label, dict(kw))] for label, kw in own.items()}
    return True, plan["on"] + plan["off"] if mode == "both" else plan[mode]


def verify_template(tokenizer: Any, *, family: str | None = None, thinking: str = "both",
                    codec: ChatCodec | None = None) -> VerifyReport:
    """Run every probe conversation against `tokenizer`'s template through our codec.

    `family` is passed to `load_codec` (forced family); `codec` skips loading (tests)."""
    switch, plan = thinking_plan(tokenizer, thinking)
    report = VerifyReport(family=None, family_requested=family, thinking_switch=switch,
                          thinking_modes=[label for label, _ in plan])
    if codec is None:
        from trajectory.codec import load_codec

        try:
            codec = load_codec(tokenizer, family=family)
        except CodecError as exc:
            report.error = f"no codec for this template: {exc}"
            return report
    report.family = codec.family
    switch, plan = thinking_plan(tokenizer, thinking, codec)
    report.thinking_switch, report.thinking_modes = switch, [label for label, _ in plan]
    template = str(getattr(tokenizer, "chat_template", "") or "")
    # a codec that maps reasoning to the template's own field (`template_messages`) renders it
    renders_reasoning = "reasoning_content" in template or hasattr(codec, "template_messages")
    for label, kw in plan:
        for sc in scenarios(reasoning=renders_reasoning and label != "off"):
            call_id = getattr(codec, "tool_call_id", None)
            sc = with_call_ids(sc, call_id) if callable(call_id) else sc
            steps, parses = play_scenario(codec, tokenizer, sc, label, kw)
            report.steps += steps
            report.parses += parses
    return report
