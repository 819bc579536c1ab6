"""Which tokens of a line are tool output: proved by the codec's own render, not by text.

A turn's prompt tokens hold its new messages as the template rendered them; which
token came from a tool message's content is not stored (a commit keeps the ids and the
messages, not a map between them). It is recovered here, per tool message, by rendering
that turn's prompt again twice with the message's content replaced by a one-digit
stand-in ("0", then "1"): the tokens the real render has where both stand-ins differ
from it are the content's, template tokens around it are equal in all three renders.
Digits are the stand-ins because byte-level pre-tokenizers never merge a digit with the
text before it, so the template's own tokens stay put; the second digit covers content
that begins or ends with the first. A token the tokenizer merged across the content's
edge holds content, and counts as tool output.

The renders go through the `ChatCodec` protocol only: `bridge` (O(the turn), what
appended turns used) and else `render_first` of the messages so far (O(context): first
turns, forks). A render counts only where its tail from the content on equals the
committed prompt's tail token for token, so a span is never a guess: a turn whose render
differs (a template that reads the clock, request-time kwargs not kept) is reported
`unknown` and shows no tool output. Costs three renders per tool message; callers cache
per turn (a committed turn never changes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from trajectory.codec.base import BridgeResult, ChatCodec, HistoryPolicy
from trajectory.turn_record import Message, TurnRecord

STAND_INS = ("0", "1")
TAIL_TOKENS = 32  # committed tokens before a turn's prompt a bridge is shown (its closing token)


def _with_content(m: Message, text: str) -> dict[str, Any]:
    """`m` with its content replaced by `text`, in the content's own shape."""
    out = dict(m)
    out["content"] = [{"type": "text", "text": text}] if isinstance(m.get("content"), list) else text
    return out


def _is_tool(m: Message) -> bool:
    c = m.get("content")
    return m.get("role") == "tool" and (isinstance(c, str) or isinstance(c, list))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _common_suffix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    return next((i for i in range(n) if a[-1 - i] != b[-1 - i]), n)


def _region(real: Sequence[int], others: Sequence[Sequence[int]]) -> tuple[int, int]:
    """[a, b) of `real` that differs from every render in `others` (the widest)."""
    a = min(_common_prefix(real, o) for o in others)
    s = min(_common_suffix(real, o, min(len(real), len(o)) - a) for o in others)
    return a, len(real) - s


class _Renders:
    """A turn's prompt rendered one way (`bridge` or `render_first`), content swapped at will."""

    def __init__(self, codec: ChatCodec, history: list[Message], tail: list[int], new: list[Message],
                 tools: Any, template_kwargs: Mapping[str, Any] | None, bridged: bool) -> None:
        self.codec, self.history, self.tail, self.new = codec, history, tail, new
        self.tools, self.kwargs, self.bridged = tools, template_kwargs, bridged
        self.raised = False  # a render raised: a None from this way proves no mismatch

    def render(self, new: list[Message]) -> list[int] | None:
        try:
            if self.bridged:
                r = self.codec.bridge(self.history, self.tail, new, tools=self.tools,
                                      template_kwargs=self.kwargs, policy=HistoryPolicy.APPEND)
                return list(r.prompt_ids) if isinstance(r, BridgeResult) else None
            return list(self.codec.render_first([*self.history, *new], tools=self.tools,
                                                template_kwargs=self.kwargs))
        except Exception:  # a render that fails proves nothing: the turn is unknown (this time)
            self.raised = True
            return None


def _ways(codec: ChatCodec, history: list[Message], tail: list[int], new: list[Message], tools: Any,
          template_kwargs: Mapping[str, Any] | None) -> Iterator[_Renders]:
    if history and history[-1].get("role") == "assistant":
        yield _Renders(codec, history, tail, new, tools, template_kwargs, True)
    yield _Renders(codec, history, tail, new, tools, template_kwargs, False)


def turn_tool_spans(codec: ChatCodec, turn: TurnRecord, prompt: Sequence[int], history: list[Message],
                    tail: list[int], *, tools: Any = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[tuple[int, int]] | None:
    """The line positions of each tool message's content in `turn`'s prompt, in message
    order ([] when it has none); None when no render of the turn matches its committed
    `prompt` (`line[turn.prompt_start:turn.output_start]`). `history`: the line's messages
    before the turn; `tail`: the committed ids just before its prompt."""
    return _turn_spans(codec, turn, prompt, history, tail, tools, template_kwargs)[0]


def _turn_spans(codec: ChatCodec, turn: TurnRecord, prompt: Sequence[int], history: list[Message],
                tail: list[int], tools: Any, template_kwargs: Mapping[str, Any] | None,
                ) -> tuple[list[tuple[int, int]] | None, bool]:
    """`turn_tool_spans`, and whether a None is only a render that raised (not proven)."""
    new: list[Message] = [dict(m) for m in turn.request_messages]
    tool_at = [k for k, m in enumerate(new) if _is_tool(m)]
    if not tool_at:
        return [], False
    prompt = [int(x) for x in prompt]
    ways = list(_ways(codec, history, tail, new, tools, template_kwargs))
    for way in ways:
        real = way.render(new)
        if real is None:
            continue
        spans: list[tuple[int, int]] = []
        for k in tool_at:
            others = [way.render([*new[:k], _with_content(new[k], s), *new[k + 1:]]) for s in STAND_INS]
            if any(o is None for o in others):
                break
            a, b = _region(real, [o for o in others if o is not None])
            back = len(real) - a  # tokens from the content's start to the prompt's end
            if back > len(prompt) or real[a:] != prompt[len(prompt) - back:]:
                break  # this render is not what was committed from here on
            start = turn.output_start - back
            spans.append((start, start + (b - a)))
        else:
            return [s for s in spans if s[1] > s[0]], False
    return None, any(w.raised for w in ways)


def line_tool_spans(codec: ChatCodec, ids: Sequence[int], turns: Sequence[TurnRecord],
                    messages: Sequence[Message], message_counts: Sequence[int], *, tools: Any = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    known: Mapping[int, list[tuple[int, int]] | None] | None = None,
                    ) -> dict[int, list[tuple[int, int]] | None]:
    """`turn_tool_spans` of every turn of a line, by the turn's `seq`; `known`: results
    already computed (by seq), not rendered again. A turn no render matched because a
    render raised is left out: unknown now, not proven so (a caller caching the results
    renders it again next time)."""
    out: dict[int, list[tuple[int, int]] | None] = {}
    for i, t in enumerate(turns):
        if known is not None and t.seq in known:
            out[t.seq] = known[t.seq]
            continue
        history = list(messages[:message_counts[i]])
        tail = [int(x) for x in ids[max(0, t.prompt_start - TAIL_TOKENS):t.prompt_start]]
        spans, raised = _turn_spans(codec, t, ids[t.prompt_start:t.output_start], history, tail,
                                    tools, template_kwargs)
        if spans is not None or not raised:
            out[t.seq] = spans
    return out
