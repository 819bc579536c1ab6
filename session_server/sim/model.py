"""What the simulated policy needs from a tokenizer and its chat template (`SimModel`),
and how one is made from a transformers tokenizer (`sim_model_from_tokenizer`). Kept apart
from the policy (sampler.py) that plays it: a model is built once per engine, read on
every request."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trajectory.codec.probe import decode_text

__all__ = ["SimModel", "sim_model_from_tokenizer"]


@dataclass(frozen=True)
class SimModel:
    """What the policy needs from a tokenizer + chat template."""

    generation_prompt_ids: tuple[int, ...]
    render: Callable[[dict[str, Any]], list[int]]  # assistant message -> ids through its EOT
    decode: Callable[[Sequence[int]], str]
    vocab_size: int
    eos_ids: tuple[int, ...]  # ids that end generation unless ignore_eos (EOT first)
    # id -> several smaller ids decoding to the same bytes, or None if it cannot be split
    splitter: Callable[[int], list[int] | None] | None = None
    name: str = "sim-model"
    # text -> ids with the real tokenizer (constrained outputs); None: constraints unsupported
    encode: Callable[[str], list[int]] | None = None
    # (function name, call index in the conversation) -> the id the model samples (Kimi
    # `functions.NAME:IDX`); None: the family's ids are not sampled (ours are minted)
    call_id: Callable[[str, int], str] | None = None
    # a prompt ending in these ids resumes the model's turn (no generation prompt follows
    # tool results: Gemma 4); () when every turn opens with the generation prompt
    resume_ids: tuple[int, ...] = ()


def sim_model_from_tokenizer(tokenizer: Any, *, name: str | None = None) -> SimModel:
    """A `SimModel` from a transformers tokenizer with a chat template.

    Uses the project codec (`trajectory.codec.load_codec(...).canonical_assistant_ids`)
    when it is available, else renders through the tokenizer's own chat template:
    render([user, assistant]) minus render([user] + generation prompt)."""
    user = [{"role": "user", "content": "hi"}]

    def chat(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    with_gen = chat(user, True)
    without = chat(user, False)
    if with_gen[: len(without)] != without:
        raise ValueError("chat template: generation prompt is not a suffix of the prompt")
    gen_ids = tuple(with_gen[len(without) :])
    special = set(tokenizer.all_special_ids)

    codec = _codec(tokenizer)
    render = None if codec is None else codec.canonical_assistant_ids
    if render is None:

        def render(message: dict[str, Any]) -> list[int]:
            msg = dict(message)
            if msg.get("tool_calls"):
                msg["tool_calls"] = [
                    {**tc, "function": {**tc["function"],
                                        "arguments": json.loads(tc["function"]["arguments"])}}
                    for tc in msg["tool_calls"]
                ]
            full = chat([*user, msg], False)
            if full[: len(with_gen)] != with_gen:
                raise ValueError("chat template does not extend the generation prompt")
            rest = full[len(with_gen) :]
            # stop after the last special token (the EOT); trailing newlines are template glue
            last = max((i for i, t in enumerate(rest) if t in special), default=len(rest) - 1)
            return rest[: last + 1]

    probe = render({"role": "assistant", "content": "ok"})
    eos = [probe[-1]]
    for t in (codec.stop_token_ids if codec is not None else ()):
        if int(t) not in eos:
            eos.append(int(t))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()

    def splitter(token_id: int) -> list[int] | None:
        if token_id in special:
            return None
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or len(piece) < 2:
            return None
        mid = len(piece) // 2
        for k in sorted(range(1, len(piece)), key=lambda k: abs(k - mid)):
            a, b = vocab.get(piece[:k]), vocab.get(piece[k:])
            if a is not None and b is not None:
                return [a, b]
        return None

    return SimModel(
        resume_ids=_resume_ids(chat, gen_ids, special | _added_special(tokenizer)),
        generation_prompt_ids=gen_ids,
        render=render,
        decode=lambda ids: decode_text(tokenizer, ids),
        vocab_size=len(tokenizer),
        eos_ids=tuple(eos),
        splitter=splitter,
        name=name or str(getattr(tokenizer, "name_or_path", "") or "sim-model"),
        encode=lambda text: [int(t) for t in tokenizer.encode(text, add_special_tokens=False)],
        call_id=getattr(codec, "tool_call_id", None),
    )


def _resume_ids(chat: Callable[[list[dict[str, Any]], bool], list[int]], gen_ids: tuple[int, ...],
                special: set[int]) -> tuple[int, ...]:
    """The template's last token after tool results when it adds no generation prompt
    there (the model resumes its own turn: Gemma 4 `<tool_response|>`); else ()."""
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "r"}]
    try:
        ids = chat(msgs, True)
    except Exception:  # noqa: BLE001 - a template without tool calls: every turn has a prompt
        return ()
    if not ids or tuple(ids[-len(gen_ids):]) == gen_ids or ids[-1] not in special or ids[-1] in gen_ids:
        return ()  # a generation prompt, or part of one (DeepSeek V3.2's `<think></think>` prefill)
    return (ids[-1],)


def _added_special(tokenizer: Any) -> set[int]:
    """Ids of added tokens marked special (Gemma's `<tool_response|>` is not in
    `all_special_ids`)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i, t in decoder.items() if getattr(t, "special", False)}


def _codec(tokenizer: Any) -> Any:
    """The project codec for this tokenizer, or None (unknown family / codec absent)."""
    try:
        from trajectory.codec import load_codec  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        codec = load_codec(tokenizer)
    except Exception:  # noqa: BLE001 - unknown family: fall back to the chat template
        return None
    return codec
