"""The template-driven codec every family builds on.

Owns render_first, close_turn, bridge and canonical_assistant_ids, all derived
from the tokenizer's own chat template via `probe_template` and re-verified on
every bridge. Families subclass it only to parse sampled text and to pin
render-time details (e.g. Llama 3.1's date).

Bridge (the TITO step): with `B = [dummy system, previous assistant with its real
tool_calls (reasoning left out)]`, ids(B) must be a prefix of ids(B + new + generation prompt); the
delta is ids(B + new)[len(ids(B)) - len(gap):], which starts with the gap. For
templates without an EOT (GLM) the delta starts with the next role token; when
the model already sampled that token as its stop token (last committed id), it
is dropped so it is not duplicated; when it sampled another role token, the
bridge refuses with ROLE_MISMATCH and the caller forks (base.py: one rule for
every role-token stop).

History rewrites are detected separately, on the real history `H`: when the
text of render(H) is not a prefix of render(H + new), the template would
re-render earlier turns (Qwen3/GLM drop earlier reasoning on a new user turn).
TEMPLATE policy refuses (HISTORY_REWRITE); APPEND policy still returns the
B-based delta, which is verified independently of the rewritten region, with
`rewrites_history=True`. Committed tokens are never changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from trajectory.codec.base import (
    BridgeRefusal,
    BridgeResult,
    HistoryPolicy,
    Message,
    ParsedAssistant,
    RefusalReason,
    ToolCallParseStatus,
    check_bridge_input,
    role_mismatch,
)
from trajectory.codec.parsing import tool_names
from trajectory.codec.probe import (
    DUMMY_SYSTEM,
    DUMMY_USER,
    ProbeResult,
    decode_text,
    encode,
    is_prefix,
    probe_template,
    render_text,
)
from trajectory.errors import CodecError

_HEADS_KEPT = 64  # `_head_ids` entries per codec (one per distinct tools list)


class TemplateCodec:
    """A `ChatCodec` driven by the tokenizer's chat template; subclasses parse."""

    family: str = "generic"
    extra_stop_tokens: tuple[str, ...] = ()  # stop ids beyond the probed EOT/boundaries

    def __init__(self, tokenizer: Any, probe: ProbeResult | None = None) -> None:
        self.tokenizer = tokenizer
        self.probe = probe if probe is not None else probe_template(tokenizer)
        self._window_heads: dict[bytes, list[int]] = {}  # `_head_ids`
        self._dated = "strftime_now" in str(getattr(tokenizer, "chat_template", "") or "")
        self.vocab_size = len(tokenizer)
        self.eot_ids = self.probe.eot_ids + self._ids_of(self.extra_eot_tokens())
        self.generation_prompt_ids = self.probe.generation_prompt_ids
        stops = list(self.eot_ids) + list(self.probe.boundary_ids)
        stops += self._ids_of(self.extra_stop_tokens)
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            stops.append(eos)
        self.stop_token_ids = tuple(dict.fromkeys(stops))
        # a template that knows the `developer` role renders it; any other gets it as
        # `system` (the caller maps it, on every turn alike)
        self.developer_role = "developer" in str(getattr(tokenizer, "chat_template", "") or "")

    # -- helpers -----------------------------------------------------------------

    def extra_eot_tokens(self) -> tuple[str, ...]:
        """Alternative end-of-turn tokens the model may sample (e.g. Llama `<|eom_id|>`)."""
        return ()

    def _ids_of(self, tokens: Sequence[str]) -> tuple[int, ...]:
        out = []
        for t in tokens:
            tid = self.tokenizer.convert_tokens_to_ids(t)
            if isinstance(tid, int) and tid != getattr(self.tokenizer, "unk_token_id", None):
                out.append(tid)
        return tuple(out)

    def _internal_kwargs(self, template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """Template kwargs for comparison renders (never for the prompt itself)."""
        return dict(template_kwargs or {})

    def _render(self, messages, *, tools, gen: bool, template_kwargs) -> str:
        return render_text(
            self.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=gen,
            template_kwargs=template_kwargs,
        )

    def _ids(self, messages, *, tools, gen: bool, template_kwargs) -> list[int]:
        return encode(
            self.tokenizer,
            self._render(messages, tools=tools, gen=gen, template_kwargs=template_kwargs),
        )

    # -- ChatCodec ---------------------------------------------------------------

    def render_first(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Whole prompt of turn 0 (or a fork), generation prompt included."""
        if not messages:
            raise CodecError("render_first needs at least one message")
        try:
            return self._ids(messages, tools=tools, gen=True, template_kwargs=template_kwargs)
        except Exception as exc:
            raise CodecError(f"{self.family}: template failed to render: {exc}") from exc

    def close_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        """EOT repair ids when the turn did not end on an EOT.

        Templates without an EOT (GLM) return []: the next role token closes the
        turn and the bridge emits it, unless the model already sampled it."""
        if not self.probe.eot_ids:
            return []
        if sampled_ids and sampled_ids[-1] in self.eot_ids:
            return []
        return [self.probe.eot_ids[0]]

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
        """New prompt ids for `new_messages` (see module doc); never a guess.

        `committed` is accepted for the protocol and unused here: TEMPLATE compares the
        text of H with H + new (the contract suite checks it for these families), and
        comparison renders pin kwargs the prompt did not (Llama 3.1's date), so they
        could not be compared with the committed ids token for token."""
        roles = ("user", "tool", "system", "assistant", "developer") if self.developer_role else (
            "user", "tool", "system", "assistant")
        refusal = check_bridge_input(history, committed_tail, new_messages, roles=roles,
                                     closing_ids=self.eot_ids if self.probe.eot_ids else None)
        if refusal is not None:
            return refusal
        kw = self._internal_kwargs(template_kwargs)
        new = list(new_messages)
        if policy == HistoryPolicy.TEMPLATE:
            # exact: the whole history, O(context); this policy forks on a rewrite anyway
            window = list(history)
        else:
            # diagnostic only (the delta below does not depend on it): the last turn
            # after a dummy query, so per-turn cost stays O(new tokens)
            window = [DUMMY_SYSTEM, DUMMY_USER, dict(history[-1])]
        try:
            h_text = self._render(window, tools=tools, gen=False, template_kwargs=kw)
            hn_text = self._render(window + new, tools=tools, gen=True, template_kwargs=kw)
            # Reasoning is left out of the base: templates show it only after the
            # last user turn (GLM, Qwen3), so it would itself flip on a user append;
            # the delta lies after the assistant turn and is verified below.
            prev = {k: v for k, v in history[-1].items() if k != "reasoning_content"}
            base = [DUMMY_SYSTEM, prev]
            ids_b = self._ids(base, tools=tools, gen=False, template_kwargs=kw)
            ids_bn = self._ids(base + new, tools=tools, gen=True, template_kwargs=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"template raised: {exc}")
        rewrites = not hn_text.startswith(h_text)
        mismatch = self._role_mismatch(committed_tail, ids_b, ids_bn)
        if mismatch is not None:
            return mismatch
        if rewrites and policy == HistoryPolicy.TEMPLATE:
            return BridgeRefusal(
                RefusalReason.HISTORY_REWRITE,
                "the template re-renders earlier turns when these messages are appended",
            )
        gap = list(self.probe.gap_ids)
        if not is_prefix(ids_b, ids_bn) or len(ids_bn) == len(ids_b):
            return BridgeRefusal(
                RefusalReason.NOT_APPEND_ONLY, "render(B) is not a prefix of render(B + new)"
            )
        if gap and ids_b[-len(gap) :] != gap:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "base render does not end in gap")
        if self.probe.eot_ids:
            at = len(ids_b) - len(gap) - 1
            if at < 0 or ids_b[at] not in self.eot_ids:
                return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "base render lacks the EOT")
        delta = ids_bn[len(ids_b) - len(gap) :]
        if not rewrites and any(m.get("role") == "assistant" for m in new):
            delta = self._positional_delta(h_text, hn_text, len(gap)) or delta
        if self.probe.boundary_ids and committed_tail and delta and committed_tail[-1] == delta[0]:
            delta = delta[1:]  # the model sampled this role token as its stop token
        offset = None
        if rewrites and policy != HistoryPolicy.TEMPLATE:
            offset = self._rewrite_offset(window, new, tools=tools, template_kwargs=kw,
                                          rendered=(h_text, hn_text))
        return BridgeResult(prompt_ids=list(delta), rewrites_history=rewrites, rewrite_offset=offset)

    def _role_mismatch(self, tail: Sequence[int], ids_b: list[int], ids_bn: list[int]) -> BridgeRefusal | None:
        """ROLE_MISMATCH when the turn ended on a sampled role token (a no-EOT template's
        boundary) other than the one the new messages render first (see base.py)."""
        if not self.probe.boundary_ids or not tail or tail[-1] not in self.probe.boundary_ids:
            return None
        if not is_prefix(ids_b, ids_bn) or len(ids_bn) == len(ids_b) or ids_bn[len(ids_b)] == tail[-1]:
            return None  # a base that does not extend is refused below; the same token is dropped
        return role_mismatch(decode_text(self.tokenizer, [tail[-1]]),
                             decode_text(self.tokenizer, [ids_bn[len(ids_b)]]))

    def _positional_delta(self, h_text: str, hn_text: str, gap_len: int) -> list[int] | None:
        """The delta as the window (a real user query before the last turn) renders it.

        B has no user message, and some templates render an assistant message by where
        it stands: Qwen3 gives the last assistant after the last query an empty
        `<think></think>` block. So a client-injected assistant message is taken from
        the window, whose render of the previous turn is not rewritten by the append
        (checked by the caller). None when its ids do not extend the window's."""
        h_ids, hn_ids = encode(self.tokenizer, h_text), encode(self.tokenizer, hn_text)
        if not is_prefix(h_ids, hn_ids) or len(hn_ids) == len(h_ids) or gap_len > len(h_ids):
            return None
        if gap_len and h_ids[-gap_len:] != list(self.probe.gap_ids):
            return None
        return hn_ids[len(h_ids) - gap_len :]

    def _rewrite_offset(self, window: list, new: list, *, tools: Any, template_kwargs: Any,
                        rendered: tuple[str, str] | None = None) -> int | None:
        """First token of the window's last assistant message that the re-render with
        `new` changes, counted from that message's output (the tokens after the
        generation prompt). O(one turn): only the window is tokenized, and only on
        a turn that rewrites. `rendered`: the window's texts without and with `new`
        when the caller has them; the head (the window before its last message, with
        the generation prompt) depends only on the tools and kwargs and is kept."""
        try:
            if rendered is None:
                rendered = (self._render(window, tools=tools, gen=False, template_kwargs=template_kwargs),
                            self._render(window + new, tools=tools, gen=True, template_kwargs=template_kwargs))
            before, after = encode(self.tokenizer, rendered[0]), encode(self.tokenizer, rendered[1])
            head = self._head_ids(window[:-1], tools=tools, template_kwargs=template_kwargs)
        except Exception:  # a diagnostic never fails a turn
            return None
        j = next((i for i, (x, y) in enumerate(zip(before, after, strict=False)) if x != y),
                 min(len(before), len(after)))
        if not is_prefix(head, before) or j < len(head):
            return None
        return j - len(head)

    def _head_ids(self, head: list, *, tools: Any, template_kwargs: Any) -> list[int]:
        """Ids of `head` (fixed messages) with the generation prompt, kept per tools and
        kwargs: a render is a function of its inputs, unless the template reads the clock
        (then never kept)."""
        key: bytes | None = None
        if not self._dated:  # a template that reads the clock renders differently tomorrow
            try:  # key order kept: `tojson` renders the tools in their own order
                key = orjson.dumps([head, tools, template_kwargs])
            except TypeError:
                key = None
        ids = self._window_heads.get(key) if key is not None else None
        if ids is None:
            ids = self._ids(head, tools=tools, gen=True, template_kwargs=template_kwargs)
            if key is not None:
                if len(self._window_heads) >= _HEADS_KEPT:
                    self._window_heads.clear()
                self._window_heads[key] = ids
        return ids

    def same_tools(
        self,
        a: Sequence[Mapping[str, Any]] | None,
        b: Sequence[Mapping[str, Any]] | None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """Whether tool lists `a` and `b` give the model the same prompt.

        Compared as the template renders them (the tools-only prefix: a system and a
        user message, since Llama 3.1 puts tools in the first user message), so a key
        reorder the template renders identically is no change. Identical JSON (typed:
        `1`, `1.0` and `true` differ) needs no render. A list the template cannot render
        is a change (its turn then fails to render with a 400)."""
        if json.dumps(a or []) == json.dumps(b or []):
            return True
        kw = self._internal_kwargs(template_kwargs)
        base = [DUMMY_SYSTEM, DUMMY_USER]
        try:
            ra = self._render(base, tools=a or None, gen=False, template_kwargs=kw)
            rb = self._render(base, tools=b or None, gen=False, template_kwargs=kw)
        except Exception:  # a template error on client tools: not the same prompt
            return False
        return ra == rb

    def canonical_assistant_ids(
        self, message: Message, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Ids the template renders for `message` after the generation prompt, through
        its EOT (GLM: through the role token the model samples to stop)."""
        kw = self._internal_kwargs(template_kwargs)
        base = [DUMMY_SYSTEM, DUMMY_USER]
        try:
            p_text = self._render(base, tools=None, gen=True, template_kwargs=kw)
            f_text = self._render(base + [message], tools=None, gen=False, template_kwargs=kw)
        except Exception as exc:
            raise CodecError(f"{self.family}: cannot render assistant message: {exc}") from exc
        if not f_text.startswith(p_text):
            raise CodecError(f"{self.family}: assistant render does not extend the prompt")
        p_ids, f_ids = encode(self.tokenizer, p_text), encode(self.tokenizer, f_text)
        if is_prefix(p_ids, f_ids):
            ids = f_ids[len(p_ids) :]
        else:  # the prompt's last token merges with the reply; the model samples after it
            ids = encode(self.tokenizer, f_text[len(p_text) :])
        gap = list(self.probe.gap_ids)
        if gap:
            if ids[-len(gap) :] != gap:
                raise CodecError(f"{self.family}: assistant render does not end in the gap")
            ids = ids[: -len(gap)]
        if self.probe.eot_ids:
            if not ids or ids[-1] not in self.eot_ids:
                raise CodecError(f"{self.family}: assistant render does not end in the EOT")
            return ids
        stop = self.probe.tool_boundary_id if message.get("tool_calls") else None
        stop = stop if stop is not None else self.probe.user_boundary_id
        if stop is None:
            raise CodecError(f"{self.family}: no stop token for this assistant message")
        return ids + [stop]

    def parse_assistant(
        self,
        sampled_ids: Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ParsedAssistant:
        """Decode (special tokens kept, text exact), drop the final stop token, parse.

        Parsed as the request that sampled it: tool calls only when it offered `tools`,
        and only to their names; reasoning only when thinking is on in `template_kwargs`."""
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        try:
            text = decode_text(self.tokenizer, ids)
        except Exception as exc:  # ids outside the vocabulary
            return ParsedAssistant(
                content="",
                reasoning_content=None,
                status=ToolCallParseStatus.INVALID_FORMAT,
                status_detail=f"undecodable ids: {exc}",
            )
        return self.parse_text(text, names=tool_names(tools), thinking=self.thinking(template_kwargs))

    def thinking(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the model reasons before answering: off only when the template's own
        switch is (`enable_thinking` is false, as the Qwen3 template tests it)."""
        return (template_kwargs or {}).get("enable_thinking") is not False

    def parse_text(self, text: str, *, names: frozenset[str] = frozenset(), thinking: bool = True) -> ParsedAssistant:
        """Family grammar; the generic codec keeps the text as content."""
        return ParsedAssistant(content=text, reasoning_content=None)
