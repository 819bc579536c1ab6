"""A tiny byte-level tokenizer + chat format for fast simulator tests (no transformers).

Ids: 0 pad, 1 `<|im_start|>`, 2 `<|im_end|>` (EOT), 3 `<|endoftext|>`, 4..259 the
bytes, then one id per merged byte pair in `_PAIRS`. Encoding merges pairs greedily,
so splitting a pair id into its two byte ids is a non-canonical segmentation of the
same bytes. The assistant format imitates ChatML with `<think>` and `<tool_call>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from session_server.sim.sampler import SimModel

__all__ = ["TOY_EOT", "toy_encode", "toy_model"]

TOY_IM_START, TOY_EOT, TOY_EOS = 1, 2, 3
_SPECIAL = {TOY_IM_START: "<|im_start|>", TOY_EOT: "<|im_end|>", TOY_EOS: "<|endoftext|>"}
_PAIRS = ("th", "he", "in", "er", "an", " t", " a", "e ", "s ", "t ", "re", "on", "al", "le")
_PAIR_IDS = {p.encode(): 260 + i for i, p in enumerate(_PAIRS)}
VOCAB_SIZE = 260 + len(_PAIRS)


def toy_encode(text: str) -> list[int]:
    data = text.encode()
    out: list[int] = []
    i = 0
    while i < len(data):
        pid = _PAIR_IDS.get(data[i : i + 2])
        if pid is not None:
            out.append(pid)
            i += 2
        else:
            out.append(data[i] + 4)
            i += 1
    return out


def toy_decode(ids: Sequence[int]) -> str:
    parts: list[str] = []
    buf = bytearray()
    for t in ids:
        if t in _SPECIAL:
            parts.append(buf.decode(errors="replace"))
            buf.clear()
            parts.append(_SPECIAL[t])
        elif 4 <= t < 260:
            buf.append(t - 4)
        elif 260 <= t < VOCAB_SIZE:
            buf.extend(_PAIRS[t - 260].encode())
    parts.append(buf.decode(errors="replace"))
    return "".join(parts)


def toy_render(message: dict[str, Any]) -> list[int]:
    text = ""
    if message.get("reasoning_content"):
        text += f"<think>\n{message['reasoning_content']}\n</think>\n\n"
    text += message.get("content") or ""
    for tc in message.get("tool_calls") or []:
        fn = tc["function"]
        body = json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])})
        text += f"\n<tool_call>\n{body}\n</tool_call>"
    return toy_encode(text) + [TOY_EOT]


def _split(token_id: int) -> list[int] | None:
    if 260 <= token_id < VOCAB_SIZE:
        return [b + 4 for b in _PAIRS[token_id - 260].encode()]
    return None


def toy_generation_prompt() -> list[int]:
    return [TOY_IM_START, *toy_encode("assistant\n")]


def toy_prompt(*turns: tuple[str, str]) -> list[int]:
    """ChatML-like prompt ids for (role, text) turns, ending with the generation prompt."""
    ids: list[int] = []
    for role, text in turns:
        ids += [TOY_IM_START, *toy_encode(f"{role}\n{text}"), TOY_EOT, *toy_encode("\n")]
    return ids + toy_generation_prompt()


def toy_model() -> SimModel:
    return SimModel(
        generation_prompt_ids=tuple(toy_generation_prompt()),
        render=toy_render,
        decode=toy_decode,
        vocab_size=VOCAB_SIZE,
        eos_ids=(TOY_EOT, TOY_EOS),
        splitter=_split,
        name="toy-chatml",
    )
