"""The codec contract: what every chat-template family provides.

A codec turns OpenAI-style messages into prompt token ids for the *first* turn,
and for every later turn returns only the *new* prompt tokens, never touching
tokens that are already committed (in particular the tokens the model sampled).

Guarantee of `bridge` (the TITO equation). Let `C` be the committed token ids of
a branch whose last turn was closed by `close_turn`, `H` its message history and
`N` the new messages. If `bridge` returns `BridgeResult(r)` then

    C + r.prompt_ids

is what the model must see next, where `r.prompt_ids` is exactly the rendering
of `N` plus the generation prompt as the template places it after the previous
assistant turn, and `C` is unchanged. When the codec cannot *prove* this (the
template is not append-only for this step), it returns a `BridgeRefusal`: a
value, never a guess and never a silent re-tokenization.

Role-token stops (one rule for every family whose turn ends with the *next* message's
role token: GLM `<|user|>` / `<|observation|>`, through our template codec or the
`renderers` one). The sampled role token is committed with mask 1 and never changed.
When the new messages' render starts with that same token, the delta continues after
it (the token is not repeated). When it starts with another one (the model sampled
`<|observation|>` after tool calls, the agent answers with a user message), no delta
is what the template renders: `...<|observation|><|user|>` is a sequence the model
never sees in training, and dropping or replacing the sampled token would rewrite what
the model did. So the bridge refuses with `ROLE_MISMATCH` and the caller forks under
*either* history policy: the new branch is the template's own render of the whole
history (the earlier assistant turns as prompt), while the branch that holds the
sampled role token stays in the tree exactly as sampled, a sample of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]
"""An OpenAI chat message as a plain mapping (role, content, tool_calls, ...)."""


class HistoryPolicy(enum.StrEnum):
    """What to do when the template would rewrite earlier turns."""

    APPEND = "append"  # keep what the model saw; bridge the new messages anyway
    TEMPLATE = "template"  # follow the template: refuse, so the caller forks a branch


class RefusalReason(enum.StrEnum):
    """Why a bridge could not be proven append-only."""

    HISTORY_REWRITE = "history_rewrite"  # template re-renders earlier turns (Qwen3 user after reasoning)
    NOT_APPEND_ONLY = "not_append_only"  # render(B) is not a prefix of render(B + new)
    UNSUPPORTED_MESSAGE = "unsupported_message"  # role/shape the family cannot place here
    RENDER_FAILED = "render_failed"  # the template raised (e.g. Llama 3.1: two tool calls)
    # the model ended its turn by sampling the next message's role token (GLM `<|observation|>`)
    # and the new message needs another one (`<|user|>`): nothing appended after the sampled
    # token is what the template renders, so the caller forks under either policy
    ROLE_MISMATCH = "role_mismatch"


@dataclass(frozen=True)
class BridgeResult:
    """New prompt tokens (mask 0) to append after the committed tokens."""

    prompt_ids: list[int]
    rewrites_history: bool = False  # a full re-render would differ before this point (diagnostic)
    # where, in tokens from the start of the last committed assistant message's output:
    # the first token a re-render of that message (with the new messages after it) changes;
    # None when unknown or when the rewrite is at the turn boundary (the closing tokens)
    rewrite_offset: int | None = None


@dataclass(frozen=True)
class BridgeRefusal:
    """The codec refuses to bridge; the caller forks a branch or answers 400."""

    reason: RefusalReason
    detail: str


class ToolCallParseStatus(enum.StrEnum):
    """Parse status of the sampled text, kept as data (never raised)."""

    OK = "ok"  # no tool-call markup, or every call parsed
    INVALID_JSON = "invalid_json"  # a tool call body is not valid JSON
    INVALID_FORMAT = "invalid_format"  # markup present but malformed (unclosed tag, missing name)


@dataclass(frozen=True)
class ParsedToolCall:
    id: str  # call_<hex>
    name: str
    arguments: str  # JSON string, as OpenAI clients expect


@dataclass(frozen=True)
class ParsedAssistant:
    """An assistant message recovered from sampled ids."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    status: ToolCallParseStatus = ToolCallParseStatus.OK
    status_detail: str = ""

    def to_message(self) -> dict[str, Any]:
        """The OpenAI assistant message; tool_calls only when present."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments},
                }
                for tc in self.tool_calls
            ]
        return msg


@runtime_checkable
class ChatCodec(Protocol):
    """One chat-template family. Special-token ids are resolved at construction."""

    family: str
    vocab_size: int
    eot_ids: tuple[int, ...]  # tokens that close an assistant turn when sampled
    stop_token_ids: tuple[int, ...]  # ids the engine should stop on (EOT, EOS, GLM role tokens)
    generation_prompt_ids: tuple[int, ...]
    developer_role: bool  # the template renders `developer`; else callers map it to `system`

    def render_first(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Whole prompt of turn 0 (or of a forked branch), generation prompt included."""
        ...

    def close_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        """Mask-0 repair tokens that close a turn whose last sampled token is not an
        end-of-turn token (finish length/abort/stop string); empty when already closed."""
        ...

    def bridge(
        self,
        history: Sequence[Message],
        committed_tail: Sequence[int],
        new_messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        policy: HistoryPolicy = HistoryPolicy.APPEND,
        committed: Sequence[int] | None = None,
    ) -> BridgeResult | BridgeRefusal:
        """New prompt ids for `new_messages` after the committed history (see module doc).

        `history` is the branch's committed messages (last one is the assistant
        message we returned); `committed_tail` the last few committed token ids
        (at least the closed previous turn's final tokens), used to drop a
        boundary token the model already sampled (GLM role tokens). `committed`:
        all committed ids of the branch (prompt and sampled tokens), given under
        TEMPLATE policy (O(context) there) so the codec refuses with HISTORY_REWRITE
        exactly when they are not a prefix of the full re-render of history + new
        (a rewrite at the edge of the sampled tokens, e.g. a prefilled `<think>`
        re-tokenized, is invisible to a message-level comparison)."""
        ...

    def parse_assistant(
        self,
        sampled_ids: Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ParsedAssistant:
        """Reasoning, content and tool calls from the sampled ids; never raises on bad markup.

        Parsed as the request that sampled them: tool calls only when it sent `tools`
        (none: the text is content), only to those names; no reasoning split when its
        `template_kwargs` turn thinking off. Text is decoded exactly (`decode_text`)."""
        ...

    def same_tools(
        self,
        a: Sequence[Mapping[str, Any]] | None,
        b: Sequence[Mapping[str, Any]] | None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """Whether two tool lists render the same prompt (a change of tools forks)."""
        ...

    def canonical_assistant_ids(self, message: Message) -> list[int]:
        """The ids the template renders for `message` after the generation prompt,
        through its end-of-turn/stop token: what a model sampling canonically emits."""
        ...


def extend_committed(full: Sequence[int], committed: Sequence[int]) -> BridgeResult | BridgeRefusal:
    """TEMPLATE policy's exact bridge: the full re-render `full` of history + new must
    extend every committed id (prompt and sampled alike), else HISTORY_REWRITE with the
    first difference; the delta is its tail. Sees a rewrite at the edge of the sampled
    tokens (a prefilled `<think>` dropped or re-tokenized) that a message-level
    comparison misses."""
    done = [int(t) for t in committed]
    if list(full[: len(done)]) != done:
        k = next((i for i, (x, y) in enumerate(zip(done, full, strict=False)) if x != y),
                 min(len(done), len(full)))
        return BridgeRefusal(
            RefusalReason.HISTORY_REWRITE,
            f"the template re-renders committed tokens when these messages are appended "
            f"(first difference at token {k} of {len(done)})",
        )
    if len(full) == len(done):
        return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "the full render adds no tokens")
    return BridgeResult(prompt_ids=list(full[len(done):]))


def role_mismatch(sampled: str, needed: str) -> BridgeRefusal:
    """The refusal of a bridge whose sampled role-token stop (`sampled`, its text) is not
    the role token the new messages render with (`needed`): see the module doc."""
    return BridgeRefusal(
        RefusalReason.ROLE_MISMATCH,
        f"the model ended its turn with {sampled!r} but the next message starts with {needed!r}: "
        "the template never renders one role token after another, so the turn forks "
        "(the sampled token stays on the previous branch)",
    )


def check_bridge_input(
    history: Sequence[Message],
    committed_tail: Sequence[int],
    new_messages: Sequence[Message],
    *,
    roles: Collection[str],
    closing_ids: Collection[int] | None,
    tail_required: bool = False,
    refused_roles: Mapping[str, str] | None = None,
    unknown_role: str = "unknown role in new messages",
) -> BridgeRefusal | None:
    """The checks every codec's `bridge` makes before it renders anything, in this order
    (so every codec refuses the same input with the same reason): the history ends with
    the assistant turn being bridged from; there are new messages; no new message has a
    role of `refused_roles` (role -> why, the family's own rule) and every one has a role
    of `roles` (else `unknown_role`); the previous turn was closed (`close_turn`): the last
    committed id is one of `closing_ids`. `closing_ids=None`: the family has no token that
    must close a turn (no check); `tail_required`: an empty `committed_tail` is not closed.
    None when all hold."""
    if not history or history[-1].get("role") != "assistant":
        return BridgeRefusal(RefusalReason.UNSUPPORTED_MESSAGE, "history must end with the assistant turn")
    if not new_messages:
        return BridgeRefusal(RefusalReason.UNSUPPORTED_MESSAGE, "no new messages")
    refused = refused_roles or {}
    for m in new_messages if refused else ():
        role = m.get("role")
        if isinstance(role, str) and role in refused:
            return BridgeRefusal(RefusalReason.UNSUPPORTED_MESSAGE, refused[role])
    if any(m.get("role") not in roles for m in new_messages):
        return BridgeRefusal(RefusalReason.UNSUPPORTED_MESSAGE, unknown_role)
    if closing_ids is not None and (committed_tail or tail_required):
        if not committed_tail or committed_tail[-1] not in closing_ids:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "previous turn is not closed (call close_turn)")
    return None
