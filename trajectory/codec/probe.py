"""Probing a chat template with its own tokenizer.

Owns rendering/encoding helpers shared by every codec and `probe_template`,
which derives, from probe conversations rendered by the tokenizer's own
template: the end-of-turn token (EOT), the gap the template emits after it, the
generation prompt, the boundary tokens of templates without an EOT (GLM: the
next role token closes the turn), and which roles append without rewriting
earlier turns. Nothing here is assumed: every derived value is checked against
the template's own renders, and failures raise `TemplateNotSupported`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trajectory.codec.pieces import piece_encoder
from trajectory.codec.render import render_chat
from trajectory.errors import TemplateNotSupported
from trajectory.messages import flatten_content, parse_arguments

DUMMY_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
DUMMY_USER = {"role": "user", "content": "Go."}
_MARK = "Zq7mark"
_PROBE_CALL = {
    "id": "call_0probe",
    "type": "function",
    "function": {"name": "probe_fn", "arguments": {"x": 1}},
}


def render_form(msg: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: text content, tool-call arguments as objects.

    OpenAI clients send arguments as JSON strings; GLM and Llama 3.1 templates
    iterate or `tojson` them, so they are parsed here (a non-JSON string stays).
    """
    out = dict(msg)
    out["content"] = flatten_content(msg.get("content"))
    if msg.get("tool_calls"):
        calls = []
        for tc in msg["tool_calls"]:
            tc = dict(tc)
            if isinstance(tc.get("function"), Mapping):
                fn = dict(tc["function"])
                fn["arguments"] = parse_arguments(fn.get("arguments", {}))
                tc["function"] = fn
            calls.append(tc)
        out["tool_calls"] = calls
    elif "tool_calls" in out:
        del out["tool_calls"]  # Llama 3.1 tests `'tool_calls' in message`
    if out.get("reasoning_content") is None:
        out.pop("reasoning_content", None)
    return out


def render_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The template's text for `messages`: `apply_chat_template(tokenize=False)`'s
    (rendered by `render.render_chat`, which gives the same text at a fraction of the cost)."""
    out = render_chat(
        tokenizer,
        [render_form(m) for m in messages],
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
    )
    if not isinstance(out, str):
        raise TemplateNotSupported(f"apply_chat_template(tokenize=False) returned {type(out)}")
    return out


def encode(tokenizer: Any, text: str) -> list[int]:
    """Ids of already-rendered template text (the template places BOS itself).

    A fast tokenizer's Rust core is asked directly when its class encodes as
    transformers' own fast tokenizer does (not a subclass that rewrites the text first,
    as CodeLlama's infilling split does) and its state is the one
    `encode(add_special_tokens=False)` would set (no truncation, no padding, special
    tokens matched): the same ids without the wrapper's per-call cost, which exceeds the
    encoding of a short turn. Where its description allows (`pieces.py`), only the
    pieces between added tokens not seen before are tokenized."""
    core = getattr(tokenizer, "backend_tokenizer", None)
    if (core is not None and _encodes_as_core(type(tokenizer)) and core.truncation is None
            and core.padding is None and not getattr(tokenizer, "split_special_tokens", False)
            and not core.encode_special_tokens):
        pieces = piece_encoder(core)
        if pieces is not None:
            return pieces.encode(text)
        return core.encode(text, add_special_tokens=False).ids  # type: ignore[no-any-return]
    return list(tokenizer.encode(text, add_special_tokens=False))


_core_classes: dict[tuple[type, tuple[str, ...]], bool] = {}


_ENCODE_PATH = ("encode", "_encode_plus", "__call__", "tokenize")
_DECODE_PATH = ("decode", "_decode")


def _encodes_as_core(cls: type) -> bool:
    """Whether `cls` inherits transformers' fast-tokenizer `encode` path unchanged."""
    return _inherits_unchanged(cls, _ENCODE_PATH)


def _inherits_unchanged(cls: type, names: tuple[str, ...]) -> bool:
    """Whether `cls` is transformers' fast tokenizer with `names` as it defines them."""
    known = _core_classes.get((cls, names))
    if known is None:
        base: Any
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
            base = TokenizersBackend
        except ImportError:  # another transformers: its own path
            base = None
        known = base is not None and issubclass(cls, base) and all(
            getattr(cls, name, None) is getattr(base, name, None) for name in names)
        _core_classes[(cls, names)] = known
    return known


def decode_text(tokenizer: Any, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """The exact text of `ids`: the one way sampled ids become text.

    `clean_up_tokenization_spaces` is always off: a tokenizer whose config turns it
    on (the real Llama 3.2 one, honoured by transformers 4.x) would otherwise drop
    the space before punctuation, so `Bonjour !` or tool code `print(a , b)` reach
    the agent as `Bonjour!` / `print(a, b)` while the committed ids say otherwise."""
    plain = [int(t) for t in ids]
    core = getattr(tokenizer, "backend_tokenizer", None)
    if core is not None and _inherits_unchanged(type(tokenizer), _DECODE_PATH):
        # what transformers' fast `decode` does with the clean-up off, less its per-call
        # conversion of the ids (which cost more than decoding a short turn)
        return str(core.decode(plain, skip_special_tokens=skip_special_tokens))
    return str(tokenizer.decode(plain, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False))


def is_prefix(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) <= len(b) and list(b[: len(a)]) == list(a)


@dataclass(frozen=True)
class ProbeResult:
    """What the template does around an assistant turn, derived and verified."""

    eot_ids: tuple[int, ...]  # rendered right after assistant content ((): none, GLM)
    gap_ids: tuple[int, ...]  # rendered after the EOT, never sampled (ChatML "\n")
    generation_prompt_ids: tuple[int, ...]
    boundary_ids: tuple[int, ...]  # no-EOT templates: role tokens that close a turn
    user_boundary_id: int | None  # the boundary token before a user turn
    tool_boundary_id: int | None  # the boundary token before a tool turn
    append_only_roles: frozenset[str]  # roles appendable after a reasoning turn
    supports_tools: bool


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def _first_delta(tokenizer: Any, base: list[dict], new: list[dict], tools: Any) -> int | None:
    """The first token the template emits after `base` when `new` follows; None if
    the longer render does not extend the shorter one."""
    short = encode(
        tokenizer, render_text(tokenizer, base, tools=tools, add_generation_prompt=False)
    )
    long = encode(
        tokenizer, render_text(tokenizer, base + new, tools=tools, add_generation_prompt=False)
    )
    if not is_prefix(short, long) or len(long) == len(short):
        return None
    return long[len(short)]


def probe_template(tokenizer: Any) -> ProbeResult:
    """Derive and verify EOT, gap, generation prompt and boundary tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateNotSupported("tokenizer has no chat template")
    special = _special_ids(tokenizer)
    user = {"role": "user", "content": "Hello there."}
    try:
        base = [DUMMY_SYSTEM, user]
        p_no = encode(tokenizer, render_text(tokenizer, base, add_generation_prompt=False))
        p_gen = encode(tokenizer, render_text(tokenizer, base, add_generation_prompt=True))
        if not is_prefix(p_no, p_gen) or len(p_gen) == len(p_no):
            raise TemplateNotSupported("generation prompt does not extend the rendered prompt")
        gen = tuple(p_gen[len(p_no) :])

        asst = {"role": "assistant", "content": _MARK}
        text = render_text(tokenizer, base + [asst], add_generation_prompt=False)
        at = text.rfind(_MARK)
        if at < 0:
            raise TemplateNotSupported("assistant content is not rendered verbatim")
        tail = encode(tokenizer, text[at + len(_MARK) :])
        full = encode(tokenizer, text)
        if tail and full[-len(tail) :] != tail:
            raise TemplateNotSupported("end-of-turn tokens depend on the assistant content")
        eot: tuple[int, ...]
        if tail and tail[0] in special:
            eot, gap = (tail[0],), tuple(tail[1:])
        elif not tail:
            eot, gap = (), ()
        else:
            raise TemplateNotSupported(f"unexpected text after assistant content: {tail!r}")

        supports_tools = _renders_tool_call(tokenizer, base)
        boundary: list[int] = []
        user_b = tool_b = None
        if not eot:
            user_b = _first_delta(
                tokenizer, base + [asst], [{"role": "user", "content": "u"}], None
            )
            if supports_tools:
                tool_b = _first_delta(
                    tokenizer,
                    base + [dict(asst, tool_calls=[_PROBE_CALL])],
                    [{"role": "tool", "tool_call_id": "call_0probe", "content": "r"}],
                    None,
                )
            for b in (user_b, tool_b):
                if b is None or b not in special:
                    raise TemplateNotSupported(
                        "no end-of-turn token and no role token closes a turn"
                    )
                if b not in boundary:
                    boundary.append(b)

        roles = set()
        reasoning_asst = {"role": "assistant", "content": "A", "reasoning_content": "R"}
        follow = {
            "user": {"role": "user", "content": "next"},
            "tool": {"role": "tool", "tool_call_id": "call_0probe", "content": "r"},
        }
        for role, msg in follow.items():
            prev = (
                dict(reasoning_asst, tool_calls=[_PROBE_CALL]) if role == "tool" else reasoning_asst
            )
            if role == "tool" and not supports_tools:
                continue
            try:
                closed = render_text(tokenizer, base + [prev], add_generation_prompt=False)
                followed = render_text(tokenizer, base + [prev, msg], add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - this probe's message shape is one the template refuses
                # (gpt-oss raises on content + reasoning + tool calls, which transformers >= 5.2x
                # passes it as `thinking`): that role is not known to be append-only, nothing more
                continue
            if followed.startswith(closed):
                roles.add(role)
    except TemplateNotSupported:
        raise
    except Exception as exc:  # the template raised on a plain probe conversation
        raise TemplateNotSupported(f"template failed on a probe conversation: {exc}") from exc
    return ProbeResult(
        eot_ids=eot,
        gap_ids=gap,
        generation_prompt_ids=gen,
        boundary_ids=tuple(boundary),
        user_boundary_id=user_b,
        tool_boundary_id=tool_b,
        append_only_roles=frozenset(roles),
        supports_tools=supports_tools,
    )


def _renders_tool_call(tokenizer: Any, base: list[dict]) -> bool:
    """Whether the template renders an assistant tool call at all (its name appears)."""
    msg = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    try:
        text = render_text(tokenizer, base + [msg], add_generation_prompt=False)
    except Exception:
        return False
    return "probe_fn" in text and json.dumps(1) in text
