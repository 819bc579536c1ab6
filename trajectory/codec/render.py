"""A chat template's text exactly as transformers renders it, for a fraction of the cost.

The codec renders three to seven conversations per turn (the delta and its checks), and
transformers' `apply_chat_template` spends more than the template itself on each: it
deep-copies every input into plain data, and its sandbox re-derives, on every attribute
access, whether the attribute is safe, from the object's type and the name alone. Jinja
also reads `message.role` on a dict by first failing a Python attribute lookup.

Here the template is compiled once in an environment built from transformers' own
compiled environment for that template: the same filters, globals and extensions (so
`tojson`, `raise_exception`, `strftime_now`, `namespace`, `{% generation %}` are the
very functions transformers installs), the same `trim_blocks` / `lstrip_blocks`, the
same immutable sandbox. Two things differ, neither in what a template sees:

- the sandbox's verdict per (type, attribute name) is computed once and kept: jinja's
  `is_safe_attribute` reads only those two (checked in `tests/fast/trajectory`);
- a dict's key is read directly when the name is not an attribute of `dict`, the
  result jinja's `getattr` reaches after its failed attribute lookup.

Inputs are prepared as `apply_chat_template` prepares them: keys whose value is None
dropped from each message, reasoning aliased under `thinking` / `reasoning_content`,
the tokenizer's special-tokens map as default template variables. The deep copy is
left out: the inputs are JSON data (what the dialects parse) and the immutable sandbox
cannot change them.

Each template is rendered both ways on probe conversations before its first use; any
difference, a tokenizer that is not a transformers one, or a transformers without the
compile hook keeps `apply_chat_template` for that template. A render that raises is
repeated through transformers, so every error is transformers' own.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

_transformers_compile: Any
_transformers_plain: Any
try:  # the pieces of transformers' own path that this one reproduces (transformers 5)
    from transformers.utils import chat_template_utils as _ctu

    for _name in ("_alias_reasoning_fields", "_normalize_chat_messages"):  # reproduced by `_chat`
        getattr(_ctu, _name)
    _transformers_compile = _ctu._compile_jinja_template
    _transformers_plain = _ctu._plain_template_data
except (ImportError, AttributeError):  # pragma: no cover - another transformers: always its own path
    _transformers_compile = None
    _transformers_plain = None

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' alias order
# names `apply_chat_template` / `render_jinja_template` take as their own arguments: a
# template kwarg so named means something else there (or raises), so it goes that way
_OWN_ARGUMENTS = frozenset({
    "add_generation_prompt", "chat_template", "continue_final_message", "conversation", "conversations",
    "documents", "max_length", "padding", "return_assistant_tokens_mask", "return_dict", "return_tensors",
    "sanitize_control_tokens", "tokenize", "tokenizer_kwargs", "tools", "truncation", "messages",
})
_DICT_NAMES = frozenset(dir(dict))
_STR_FORMAT = frozenset({"format", "format_map"})
_BUILTIN_METHOD: Any = type("".startswith)  # builtin_function_or_method
_MEMO_LIMIT = 4096  # (type, name) pairs; a template names a few dozen


class _OnceCheckedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with its per-(type, name) verdicts kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) < _MEMO_LIMIT:
                self._verdicts[key] = verdict
        return verdict

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_NAMES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        # a string's method (`content.startswith`, `.split`): what the sandbox returns
        # once it has found it safe, less its per-access checks (str.format is wrapped)
        if kind is str and attribute not in _STR_FORMAT and self._verdicts.get((str, attribute)):
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # a string's bound method is safe to call and takes no context: the sandbox's and
        # the context's checks say so on every call; jinja's loop/block arguments dropped
        # as `Context.call` drops them
        if type(__obj) is _BUILTIN_METHOD and type(__obj.__self__) is str and __obj.__name__ not in _STR_FORMAT:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            try:
                return __obj(*args, **kwargs)
            except StopIteration:
                return __context.environment.undefined(
                    "value was undefined because a callable raised a StopIteration exception")
        return super().call(__context, __obj, *args, **kwargs)


def _compile(template: str) -> Template | None:
    """`template` in an environment with transformers' filters, globals and extensions."""
    if _transformers_compile is None:
        return None
    reference = _transformers_compile(template).environment
    env = _OnceCheckedSandbox(
        trim_blocks=reference.trim_blocks,
        lstrip_blocks=reference.lstrip_blocks,
        extensions=[type(ext) for ext in reference.extensions.values()],
    )
    env.filters.update(reference.filters)
    env.globals.update(reference.globals)
    compiled = env.from_string(template)
    # jinja chains the template's globals over the environment's (a ChainMap) and copies
    # them into every render's context: iterating the chain cost a third of a small
    # render. Neither changes after this point, so one flat dict is the same globals.
    compiled.globals = dict(compiled.globals)
    return compiled


def _chat(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as apply_chat_template hands them to the template (see module doc)."""
    chat = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    return chat


def _via_transformers(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any,
                      add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None) -> Any:
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **dict(template_kwargs or {}),
    )


# probe conversations each template must render identically both ways before it is trusted
_CALL = {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
_PROBES: tuple[tuple[list[dict[str, Any]], Any, bool], ...] = (
    ([{"role": "user", "content": "Hi there."}], None, True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
      {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
      {"role": "user", "content": "Weather?"}], None, True),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [_CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"sunny\": true}"}], [_TOOL], True),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [_TOOL], False),
)


class _Slot:
    """One template's compiled form, or None where transformers must render it."""

    __slots__ = ("template", "compiled")

    def __init__(self, template: str, compiled: Template | None) -> None:
        self.template = template
        self.compiled = compiled


_lock = threading.Lock()
_slots: dict[str, _Slot] = {}  # template text -> slot (templates are few and long-lived)
_SLOT_LIMIT = 256


_plain_specials: weakref.WeakKeyDictionary[Any, tuple[dict[str, Any], dict[str, Any]]] = weakref.WeakKeyDictionary()


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's special-tokens map as plain template data, as transformers passes
    it; the plain copy is kept while the map stays equal (it is read on every render)."""
    tokens = dict(tokenizer.special_tokens_map)
    try:
        kept = _plain_specials.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return _transformers_plain(tokens)  # type: ignore[no-any-return]
    if kept is not None and kept[0] == tokens:
        return kept[1]
    plain = _transformers_plain(tokens)
    _plain_specials[tokenizer] = (tokens, plain)
    return plain  # type: ignore[no-any-return]


def _slot(tokenizer: Any, template: str) -> _Slot:
    slot = _slots.get(template)
    if slot is None:
        try:
            compiled = _compile(template)
            if compiled is not None and not _agrees(tokenizer, template, compiled):
                compiled = None
        except Exception:  # a template jinja or the probes cannot take: transformers' path
            compiled = None
        slot = _Slot(template, compiled)
        with _lock:
            if len(_slots) >= _SLOT_LIMIT:
                _slots.clear()
            _slots[template] = slot
    return slot


def _fast(tokenizer: Any, compiled: Template, messages: Sequence[Mapping[str, Any]], tools: Any,
          add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None) -> str:
    kwargs = {**_special_tokens(tokenizer), **dict(template_kwargs or {})}
    return compiled.render(messages=_chat(messages), tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt, **kwargs)


def _agrees(tokenizer: Any, template: str, compiled: Template) -> bool:
    """Both ways give the same text, or both raise, on every probe conversation."""
    for messages, tools, gen in _PROBES:
        try:
            if tokenizer.get_chat_template(None, tools) != template:
                continue  # a named template for the other case (tool_use / default)
        except Exception:
            continue  # no template for this case (a dict without `default`)
        try:
            want = _via_transformers(tokenizer, messages, tools, gen, None)
        except Exception:
            want = None
        try:
            got = _fast(tokenizer, compiled, messages, tools, gen, None)
        except Exception:
            got = None
        if got != want:
            return False
    return True


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """What `tokenizer.apply_chat_template(messages, tokenize=False, ...)` returns."""
    get_template = getattr(tokenizer, "get_chat_template", None)
    if (not messages or get_template is None or _transformers_compile is None
            or (template_kwargs and not _OWN_ARGUMENTS.isdisjoint(template_kwargs))
            or (tools and not all(type(t) is dict for t in tools))):  # callables become schemas there
        return _via_transformers(tokenizer, messages, tools, add_generation_prompt, template_kwargs)
    try:
        template = get_template(None, tools)
    except Exception:
        return _via_transformers(tokenizer, messages, tools, add_generation_prompt, template_kwargs)
    slot = _slot(tokenizer, template) if isinstance(template, str) else None
    if slot is None or slot.compiled is None:
        return _via_transformers(tokenizer, messages, tools, add_generation_prompt, template_kwargs)
    try:
        return _fast(tokenizer, slot.compiled, messages, tools, add_generation_prompt, template_kwargs)
    except Exception:
        # transformers' own error (or, should the two ever disagree on raising, its text)
        return _via_transformers(tokenizer, messages, tools, add_generation_prompt, template_kwargs)
