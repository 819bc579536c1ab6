"""A codec behind our `ChatCodec` interface, backed by a `renderers` renderer.

Owns adapting the `renderers` library (PyPI, Apache-2.0, pinned 0.1.12) to our
contract: render, bridge, parse, close and stop ids for the hand-coded families it
ships (Qwen3.5, GLM-4.5/4.7/5, DeepSeek V3/V4, gpt-oss, Kimi K2, MiniMax M2, ...).

Facts about renderers 0.1.12 this module relies on (read from its source, checked
by tests/fast/trajectory/test_renderers_codec.py, never assumed elsewhere):

- `create_renderer(tokenizer, config)` with a typed config from
  `config_from_name(name)` builds the renderer of family `name` (a key of its
  registry, e.g. "qwen3.5", "glm-5", "deepseek-v3", "kimi-k2", "minimax-m2",
  "gpt-oss"). With no config it matches `tokenizer.name_or_path` *exactly* against
  `MODEL_RENDERER_MAP` and silently falls back to `DefaultRenderer` (which never
  bridges): so we always pass a config and detect the family ourselves.
- Template kwargs (`enable_thinking`, ...) are config fields, validated by
  `merge_chat_template_kwargs(config, kwargs)` (unknown kwargs raise ValueError);
  one renderer per distinct kwargs, cached.
- `render_ids(messages, tools=, add_generation_prompt=)` is meant to be
  token-identical to `tokenizer.apply_chat_template` + encode for the model's own
  template. Renderers tokenize piecewise (scaffold and content separately), so
  this is a claim we check against the template (contract suite), not trust.
- `bridge_to_next_turn(prev_prompt_ids, prev_completion_ids, new_messages, tools=)`
  returns the whole next prompt (prior ids + new) or None when it cannot prove the
  prior ids stay a prefix. It refuses assistant messages in `new_messages`, scans
  the completion (with the prompt as context) for an unclosed reasoning block,
  trims the prior ids back to the last turn-close token *inside the completion*
  (synthesising the canonical close when there is none), and applies its
  `thinking_retention` policy: "template"/"tool_cycle" return None on a new user
  query (the template would drop earlier reasoning), "all" bridges anyway.
- `parse_response(ids, tools=, prompt_ids=)` strips stop tokens and returns
  content, reasoning_content and one `ParsedToolCall` per attempt (status OK or a
  typed failure); `prompt_ids` tells it whether the prompt opened reasoning.
- `get_stop_token_ids()` are the ids the engine stops on (GLM: role tokens).

How we use it. The delta of a turn comes from *their* bridge, fed a synthetic
prior that ends exactly like our committed tokens: the generation prompt of a
dummy query, then the canonical rendering of the previous assistant message
(reasoning left out, as templates drop it) whose final stop token is replaced
by the one actually committed. Their result must extend that prior unchanged
(else we refuse: they trimmed or re-rendered); the suffix is our delta, so the
committed tokens are never re-tokenized. History rewrites are detected by us as
in `TemplateCodec` (render of H a prefix of render of H + new, with the
renderer's own ids): APPEND bridges with a renderer built with
`thinking_retention="all"` and flags the rewrite. TEMPLATE, given every committed
id (the server passes them), is exact by definition: the delta is the full
re-render past the committed ids, HISTORY_REWRITE exactly when they are not its
prefix (this sees a prefilled `<think>` re-tokenized or dropped at the edge of the
sampled tokens, which a message-level comparison misses).

Our rules over the renderer (exact decoding, the parse rules every codec keeps,
the load-time comparison with the template) are in `renderers_rules.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from trajectory.codec.base import (
    BridgeRefusal,
    BridgeResult,
    HistoryPolicy,
    Message,
    ParsedAssistant,
    RefusalReason,
    ToolCallParseStatus,
    check_bridge_input,
    extend_committed,
    role_mismatch,
)
from trajectory.codec.families import ToolCallFormat, renderers_with
from trajectory.codec.parsing import parse_llama31, tool_names
from trajectory.codec.probe import (
    DUMMY_SYSTEM,
    DUMMY_USER,
    decode_text,
    encode,
    is_prefix,
    render_form,
)
from trajectory.codec.renderers_rules import (
    ExactDecode,
    dated_kwargs,
    template_difference,
    template_identity,
    to_parsed_assistant,
)
from trajectory.errors import CodecError, TemplateNotSupported

_ROLES = ("user", "tool", "system", "developer")

# families whose tool calls have no markup (the whole reply is the call's JSON): parsed
# by our grammar of the same format on the exactly decoded reply (module doc)
_BARE_JSON_CALLS = renderers_with(ToolCallFormat.BARE_JSON)


def _renderers() -> Any:
    try:
        import renderers
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise TemplateNotSupported("the `renderers` package is not installed") from exc
    return renderers


class RenderersCodec:
    """A `ChatCodec` for one `renderers` family (see module doc for the contract)."""

    def __init__(self, tokenizer: Any, renderer_name: str, *, verify: bool = True) -> None:
        """`verify`: refuse (TemplateNotSupported) when the renderer's prompts differ
        from the tokenizer's own chat template on probe conversations (see
        `template_difference`): the template is the truth of what the model was
        trained with, a renderer written for another template version is not."""
        self.tokenizer = tokenizer
        self.renderer_name = renderer_name
        self.family = renderer_name
        self.vocab_size = len(tokenizer)
        self._cache: dict[tuple[str, str], Any] = {}
        self._overrides: dict[str, Any] = {}
        try:
            fields = getattr(type(_renderers().config_from_name(self.renderer_name)), "model_fields", {})
            self._overrides = template_identity(self.tokenizer, fields)
            base = self._renderer(None)
        except Exception as exc:
            raise TemplateNotSupported(f"renderers {renderer_name!r}: {exc}") from exc
        stops = [int(t) for t in base.get_stop_token_ids()]
        self.stop_token_ids = tuple(dict.fromkeys(stops))
        self.eot_ids = self.stop_token_ids
        prompt = self._prompt_ids(None, None)
        full = self._ids([DUMMY_SYSTEM, DUMMY_USER], tools=None, gen=False, kw=None)
        if not is_prefix(full, prompt):
            raise TemplateNotSupported(f"{renderer_name}: generation prompt does not extend the history")
        self.generation_prompt_ids = tuple(prompt[len(full) :])
        closed = self.canonical_assistant_ids({"role": "assistant", "content": "ok"})
        # the close the model samples (ChatML <|im_end|>); None: the next role token
        # closes the turn (GLM), so there is nothing to repair
        self._close: int | None = closed[-1] if self._closes_itself() else None
        template = str(getattr(tokenizer, "chat_template", "") or "")
        self.developer_role = "developer" in template
        # Llama 3: the renderer pins `date_string` (26 Jul 2024); the template prints
        # today's date. Prompts follow the template; APPEND's comparison renders keep
        # the pin (the delta never holds the system block, so a date change between
        # turns cannot break it)
        config = type(_renderers().config_from_name(renderer_name))
        self._dated = "date_string" in getattr(config, "model_fields", {})
        if verify and template:
            diff = template_difference(self)
            if diff is not None:
                raise TemplateNotSupported(
                    f"renderers {renderer_name!r} does not render this tokenizer's chat template: {diff}"
                )

    # -- renderers plumbing ------------------------------------------------------

    def _renderer(self, kw: Mapping[str, Any] | None, *, retention: str | None = None) -> Any:
        """The renderer for these template kwargs (and bridge retention), cached."""
        key = (json.dumps(dict(kw or {}), sort_keys=True, default=str), retention or "")
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        r = _renderers()
        config = r.config_from_name(self.renderer_name)
        if self._overrides:
            config = type(config)(**self._overrides)
        if retention is not None:
            try:
                config = type(config)(thinking_retention=retention, **self._overrides)
            except Exception:  # the family's own knob forbids it: keep its default
                pass
        renderer = r.create_renderer(ExactDecode(self.tokenizer), config, chat_template_kwargs=dict(kw or {}) or None)
        self._cache[key] = renderer
        return renderer

    def _ids(self, messages: Sequence[Message], *, tools: Any, gen: bool, kw: Any,
             retention: str | None = None) -> list[int]:
        return list(
            self._renderer(kw, retention=retention).render_ids(
                [render_form(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=gen,
            )
        )

    def _prompt_ids(self, tools: Any, kw: Any) -> list[int]:
        return self._ids([DUMMY_SYSTEM, DUMMY_USER], tools=tools, gen=True, kw=kw)

    def _closes_itself(self) -> bool:
        """Whether an assistant render ends in a stop token of its own (an EOT)."""
        full = self._ids([DUMMY_SYSTEM, DUMMY_USER, {"role": "assistant", "content": "ok"}],
                         tools=None, gen=False, kw=None)
        tail = full[-3:]
        return any(t in self.stop_token_ids for t in tail)

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
            return self._ids(messages, tools=tools, gen=True, kw=dated_kwargs(template_kwargs, self._dated))
        except Exception as exc:
            raise CodecError(f"{self.family}: renderer failed: {exc}") from exc

    def close_turn(self, sampled_ids: Sequence[int]) -> list[int]:
        """The canonical close when the turn did not end on a stop token (their
        `trim_to_turn_close(synthesize_close=...)`); [] for role-token families."""
        if self._close is None or (sampled_ids and sampled_ids[-1] in self.stop_token_ids):
            return []
        return [self._close]

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
        """Their bridge on a synthetic prior ending like ours (module doc); never a guess.

        TEMPLATE with `committed` (all committed ids): exact by definition, the delta
        is the full re-render past the committed ids, refused when they are not its
        prefix. APPEND (or no `committed`): O(new tokens), through their bridge."""
        refusal = check_bridge_input(history, committed_tail, new_messages,
                                     roles=_ROLES if self.developer_role else _ROLES[:3],
                                     closing_ids=self.stop_token_ids if self._close is not None else None,
                                     unknown_role="renderers bridges only user/tool/system messages")
        if refusal is not None:
            return refusal
        kw = template_kwargs
        new = list(new_messages)
        mismatch = self._role_mismatch(history[-1], committed_tail, new, tools=tools, kw=kw)
        if mismatch is not None:
            return mismatch
        if policy == HistoryPolicy.TEMPLATE and committed is not None:
            return self._bridge_template(list(history) + new, committed, tools=tools, kw=kw)
        window = list(history) if policy == HistoryPolicy.TEMPLATE else [DUMMY_SYSTEM, DUMMY_USER, dict(history[-1])]
        try:
            extended = self._ids(window + new, tools=tools, gen=True, kw=kw)
            rewrites = not is_prefix(self._ids(window, tools=tools, gen=False, kw=kw), extended)
            prompt = self._prompt_ids(tools, kw)
            prev = {k: v for k, v in history[-1].items() if k != "reasoning_content"}
            completion = self._completion_ids(prev, prompt, tools=tools, kw=kw)
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"renderer raised: {exc}")
        if rewrites and policy == HistoryPolicy.TEMPLATE:
            return BridgeRefusal(
                RefusalReason.HISTORY_REWRITE,
                "the template re-renders earlier turns when these messages are appended",
            )
        last = committed_tail[-1] if committed_tail else None
        if completion and completion[-1] in self.stop_token_ids:
            completion = completion[:-1]
        completion = self._close_reasoning(prompt, completion)
        if last is not None and last in self.stop_token_ids:
            completion = [*completion, last]  # the role token new messages start with (checked above)
        prior = prompt + completion
        try:
            out = self._renderer(kw, retention="all").bridge_to_next_turn(
                list(prompt), list(completion), [render_form(m) for m in new],
                tools=list(tools) if tools else None,
            )
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"renderers bridge raised: {exc}")
        if out is None:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "renderers cannot prove this step append-only")
        ids = list(out.token_ids)
        if not is_prefix(prior, ids):
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "renderers bridge changed the prior tokens")
        delta = ids[len(prior) :]
        if not delta:
            return BridgeRefusal(RefusalReason.NOT_APPEND_ONLY, "renderers bridge added no tokens")
        if extended[-len(delta):] != delta:
            # their bridge and their own full render disagree on the new tokens (MiniMax M2:
            # the template, and render_ids, drop a system message past the first; the bridge
            # renders it): no exact delta to claim. TEMPLATE forks (render_first follows the
            # template); APPEND answers 409
            return BridgeRefusal(
                RefusalReason.NOT_APPEND_ONLY,
                "renderers bridge renders the new messages unlike its own full render "
                f"({decode_text(self.tokenizer, delta[:16])!r} vs "
                f"{decode_text(self.tokenizer, extended[-len(delta):][:16])!r})",
            )
        return BridgeResult(prompt_ids=delta, rewrites_history=rewrites)

    def _bridge_template(self, messages: list[Message], committed: Sequence[int], *, tools: Any,
                         kw: Any) -> BridgeResult | BridgeRefusal:
        """TEMPLATE policy: the full re-render of history + new must extend the
        committed ids token for token (prompt and sampled tokens alike), else the
        template would rewrite what the model saw: HISTORY_REWRITE. This sees rewrites
        a message-level comparison misses: a prefilled `<think>` (Qwen3.5, GLM-4.6,
        GLM-4.7) whose re-render tokenizes the reasoning boundary differently, or
        drops the opener. O(context): this policy forks on a rewrite anyway."""
        try:
            full = self._ids(messages, tools=tools, gen=True, kw=dated_kwargs(kw, self._dated))
        except Exception as exc:
            return BridgeRefusal(RefusalReason.RENDER_FAILED, f"renderer raised: {exc}")
        return extend_committed(full, committed)

    def _close_reasoning(self, prompt: list[int], completion: list[int]) -> list[int]:
        """The synthetic completion with `</think>` first when the prompt leaves reasoning
        open and the re-render of a message without reasoning never closes it (MiniMax
        M2: prompt `<think>\n`, render `ok`): a model always closes it before its answer,
        and their bridge refuses a turn that stopped inside reasoning. Only the synthetic
        prior changes; the delta after it does not."""
        if not decode_text(self.tokenizer, prompt).rstrip().endswith("<think>"):
            return completion
        if "</think>" in decode_text(self.tokenizer, completion):
            return completion
        return [*encode(self.tokenizer, "</think>"), *completion]

    def _completion_ids(self, message: Message, prompt: list[int], *, tools: Any, kw: Any) -> list[int]:
        """What a model sampling `message` canonically emits after `prompt` (through
        its stop token where the family has one)."""
        full = self._ids([DUMMY_SYSTEM, DUMMY_USER, message], tools=tools, gen=False, kw=kw)
        if is_prefix(prompt, full):
            ids = full[len(prompt) :]
        else:  # the prompt's last token merges with the reply (Qwen3.5 `<think>\n`)
            p_text = decode_text(self.tokenizer, prompt)
            f_text = decode_text(self.tokenizer, full)
            if f_text.startswith(p_text):
                ids = list(self.tokenizer.encode(f_text[len(p_text) :], add_special_tokens=False))
            else:
                ids = self._after_prefill(prompt, full)
        # drop what the template renders after the close (ChatML "\n"): never sampled
        cut = max((i for i, t in enumerate(ids) if t in self.stop_token_ids), default=None)
        return ids if cut is None else ids[: cut + 1]

    def _after_prefill(self, prompt: list[int], full: list[int]) -> list[int]:
        """The prompt opens reasoning that a re-render of a message without reasoning
        shows otherwise: dropped (GLM-4.7, MiniMax M2: prompt `<think>`, render `ok`) or
        closed without the prompt's whitespace (Nemotron 3: prompt `<think>\n`, render
        `<think></think>ok`). The model samples the rest of the render after where the
        two part (`</think>ok`); the prompt's own tail there may only be the opener
        and whitespace, else the render is not a continuation of the prompt."""
        k = next((i for i, (x, y) in enumerate(zip(prompt, full, strict=False)) if x != y),
                 min(len(prompt), len(full)))
        rest = decode_text(self.tokenizer, prompt[k:]).strip()
        opens = decode_text(self.tokenizer, prompt).rstrip().endswith("<think>")
        if not opens or rest not in ("<think>", ""):
            raise CodecError(f"{self.family}: assistant render does not extend the prompt")
        return full[k:]

    def _role_mismatch(self, prev: Message, tail: Sequence[int], new: list[Message], *, tools: Any,
                       kw: Any) -> BridgeRefusal | None:
        """Role-token families (no close of their own: GLM): ROLE_MISMATCH when the turn
        ended on a sampled role token the new messages do not render first (base.py's
        rule). O(one turn): the previous message alone, after a dummy query."""
        if self._close is not None or not tail or tail[-1] not in self.stop_token_ids:
            return None
        base = [DUMMY_SYSTEM, DUMMY_USER, {k: v for k, v in prev.items() if k != "reasoning_content"}]
        try:
            ids_b = self._ids(base, tools=tools, gen=False, kw=kw)
            ids_bn = self._ids([*base, *new], tools=tools, gen=True, kw=kw)
        except Exception:  # noqa: BLE001 - the bridge itself reports a renderer failure
            return None
        if not is_prefix(ids_b, ids_bn) or len(ids_bn) == len(ids_b) or ids_bn[len(ids_b)] == tail[-1]:
            return None
        return role_mismatch(decode_text(self.tokenizer, [tail[-1]]),
                             decode_text(self.tokenizer, [ids_bn[len(ids_b)]]))

    def parse_assistant(
        self,
        sampled_ids: Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ParsedAssistant:
        """Their `parse_response`, mapped to ours with our rules (module doc); never
        raises on bad markup."""
        ids = [int(t) for t in sampled_ids]
        if self.renderer_name in _BARE_JSON_CALLS:
            return self._parse_bare_json(ids, tools)
        try:
            parsed = self._renderer(template_kwargs).parse_response(
                ids, tools=list(tools) if tools else None, prompt_ids=self._prompt_ids(tools, template_kwargs)
            )
        except Exception as exc:
            return ParsedAssistant(
                content="", reasoning_content=None,
                status=ToolCallParseStatus.INVALID_FORMAT, status_detail=f"unparseable: {exc}",
            )
        return to_parsed_assistant(parsed, tools_offered=bool(tools), tools=tools)

    def _parse_bare_json(self, ids: list[int], tools: Any) -> ParsedAssistant:
        """Llama 3: the reply up to its first stop token, decoded exactly, read by our
        Llama 3.1 grammar (the same markup-less format; module doc)."""
        cut = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), len(ids))
        try:
            text = decode_text(self.tokenizer, ids[:cut])
        except Exception as exc:  # ids outside the vocabulary
            return ParsedAssistant(content="", reasoning_content=None,
                                   status=ToolCallParseStatus.INVALID_FORMAT, status_detail=f"undecodable ids: {exc}")
        return parse_llama31(text, tool_names(tools))

    def same_tools(
        self,
        a: Sequence[Mapping[str, Any]] | None,
        b: Sequence[Mapping[str, Any]] | None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """Whether two tool lists render the same prompt (a change of tools forks)."""
        if json.dumps(a or []) == json.dumps(b or []):
            return True
        try:
            return self._prompt_ids(a or None, template_kwargs) == self._prompt_ids(b or None, template_kwargs)
        except Exception:
            return False

    def canonical_assistant_ids(
        self, message: Message, *, template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Ids the renderer places for `message` after the generation prompt, through
        its stop token (role-token families: the next role token it renders)."""
        try:
            prompt = self._prompt_ids(None, template_kwargs)
            ids = self._completion_ids(message, prompt, tools=None, kw=template_kwargs)
            if ids and ids[-1] in self.stop_token_ids:
                return ids
            follow = {"role": "tool", "content": "x"} if message.get("tool_calls") else {"role": "user", "content": "x"}
            base = [DUMMY_SYSTEM, DUMMY_USER, message]
            before = self._ids(base, tools=None, gen=False, kw=template_kwargs)
            after = self._ids([*base, follow], tools=None, gen=True, kw=template_kwargs)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"{self.family}: cannot render assistant message: {exc}") from exc
        # the first stop token where the render with a follower departs from the one
        # without (a follower may also hide this message's reasoning: GLM)
        j = next((i for i, (x, y) in enumerate(zip(before, after, strict=False)) if x != y),
                 min(len(before), len(after)))
        stop = next((t for t in after[j:] if t in self.stop_token_ids), None)
        if stop is not None:
            return ids + [stop]
        raise CodecError(f"{self.family}: no stop token after this assistant message")
