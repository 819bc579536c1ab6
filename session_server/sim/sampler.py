"""The simulator's deterministic policy: a scripted agent whose output depends only on
(seed, token context).

How one request is answered (`ScriptedPolicy.start`):
1. the current assistant turn starts after the *last* occurrence of the generation
   prompt ids, or of the model's resume ids (templates whose model continues its own
   turn after tool results with no generation prompt: Gemma 4's `<tool_response|>`);
   no occurrence: the whole context is the prompt;
2. the *planned response* is drawn from a hash of (seed, context before that point):
   while fewer tool turns have happened than the episode's script asks for
   (1-3, drawn from the episode's first prompt), reasoning plus one or two calls of
   the tools the prompt offers (`offered.py`: read from the rendered prompt, as a
   model reads them; arguments for each required parameter of the tool's schema);
   then, or at once when the prompt offers no tool, reasoning plus a final answer. It is an assistant message dict
   rendered to ids by the injected `render` (in practice the codec's
   `canonical_assistant_ids`), optionally re-segmented non-canonically;
3. tokens already sampled after the turn start are skipped, so resubmitting
   prompt + partial continues identically (abort/resubmit relies on this);
   after the plan the model emits EOS.
A test may replace step 2 with a *script* (`set_script`): turn k of an episode plays the
k-th scripted assistant message (the last one repeats), rendered to ids the same way,
so a real harness's exact calls are made. A script is kept for one session (by the
`x-tito-session` header the server sends with each generate request: the session's tag,
a digest of its id, engines/base.session_tag) or, set without
one, for every request on the engine that has no session script of its own.
Logprobs are a hash of (seed, context digest, position, token), in (-5, 0].

A request's own seed (SGLang `sampling_params.sampling_seed`, vLLM `seed`) is honoured as
the engines honour it: the same seed and context draw the same tokens, another seed
draws others (the seed is mixed into the server's: the plan and logprobs hash it). A
request without one draws with the server's seed, as every request did before. A
resubmitted partial under another seed (a derived per-segment seed) continues the plan
it was drawn from: a real engine would draw the rest afresh; the sim keeps the turn
whole and deterministic, which is all its callers can observe of that draw.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from session_server.sim.model import SimModel, sim_model_from_tokenizer
from session_server.sim.offered import OfferedTool, arguments_for, offered_tools

__all__ = ["Cursor", "ScriptedPolicy", "SimModel", "sim_model_from_tokenizer"]

_WORDS = (
    "the", "file", "config", "test", "value", "check", "list", "run", "error", "output",
    "path", "need", "first", "then", "read", "update", "function", "result", "so", "we",
    "should", "look", "at", "call", "tool", "answer", "data", "line", "fix", "it",
)
_MAX_SCRIPTS = 4096  # session scripts kept (the oldest dropped past it)


def _h(*parts: bytes | int | str) -> int:
    m = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, int):
            p = p.to_bytes(16, "little", signed=True)
        elif isinstance(p, str):
            p = p.encode()
        m.update(p)
        m.update(b"|")
    return int.from_bytes(m.digest(), "little")


def _digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(ids.astype(np.int64).tobytes(), digest_size=16).digest()


def _occurrences(ctx: np.ndarray, pattern: tuple[int, ...]) -> np.ndarray:
    """Start positions of `pattern` in `ctx` (vectorised; contexts reach 100K tokens)."""
    n, m = len(ctx), len(pattern)
    if m == 0 or n < m:
        return np.empty(0, dtype=np.int64)
    hits = np.flatnonzero(ctx[: n - m + 1] == pattern[0])
    for j in range(1, m):
        if len(hits) == 0:
            break
        hits = hits[ctx[hits + j] == pattern[j]]
    return hits


@dataclass
class Cursor:
    """The continuation of one context: token i and its logprob are pure functions."""

    planned: list[int]
    offset: int  # tokens of the planned turn already present in the context
    diverged: bool  # the context's partial turn is not the plan: close the turn
    key: bytes
    seed: int
    eos: int
    vocab_size: int
    message: dict[str, Any] = field(default_factory=dict)

    def token(self, i: int) -> int:
        p = self.offset + i
        if self.diverged or p >= len(self.planned):
            return self.eos
        return self.planned[p]

    def logprob(self, i: int, token: int) -> float:
        u = _h(self.seed, self.key, self.offset + i, token) / 2**64  # [0, 1)
        return -5.0 * u  # (-5, 0]

    def top(self, i: int, token: int, k: int) -> list[tuple[int, float]]:
        """k alternatives, sampled token first, descending logprobs."""
        lp = self.logprob(i, token)
        out = [(token, lp)]
        for j in range(1, k):
            alt = _h(self.seed, self.key, self.offset + i, "alt", j) % self.vocab_size
            if alt == token:
                alt = (alt + 1) % self.vocab_size
            out.append((alt, lp - 0.5 * j))
        return out


class ScriptedPolicy:
    """Deterministic scripted agent over a `SimModel` (see module docstring)."""

    def __init__(self, model: SimModel, *, seed: int = 0, noncanonical: bool = False) -> None:
        self.model = model
        self.seed = seed
        self.noncanonical = noncanonical and model.splitter is not None
        # (prefix, seed, script owner) -> plan
        self._plans: dict[tuple[bytes, int, str | None], tuple[list[int], dict[str, Any]]] = {}
        self._scripts: dict[str | None, list[dict[str, Any]]] = {}  # session (None: engine-wide) -> turns
        self._tools: dict[bytes, tuple[OfferedTool, ...]] = {}  # episode's first prompt -> its tools

    def set_script(self, turns: Sequence[dict[str, Any]], session: str | None = None) -> None:
        """Script the episode: turn k answers `turns[min(k, len - 1)]`; () restores the
        hashed script. Each turn is `{"content"?, "reasoning_content"?, "tool_calls"?:
        [{"name", "arguments": object}]}`; ValueError names what is malformed. `session`:
        only that session's requests play it; None: every request without a session
        script of its own (engine-wide: a later, unrelated run plays it too)."""
        script = [_scripted_message(t, k) for k, t in enumerate(turns)]
        self._scripts.pop(session, None)
        if script:
            if len(self._scripts) >= _MAX_SCRIPTS:
                self._scripts.pop(next(k for k in self._scripts if k is not None))
            self._scripts[session] = script
        self._plans.clear()

    def script_owner(self, session: str | None) -> tuple[bool, str | None]:
        """Whether a request of `session` plays a script, and whose: its own (the
        session) or the engine-wide one (None); (False, None): the hashed agent."""
        if session is not None and session in self._scripts:
            return True, session
        return None in self._scripts, None

    def _scripted(self, script: list[dict[str, Any]], h: int, tool_turns_done: int) -> dict[str, Any]:
        """The scripted message of turn `tool_turns_done`, its call ids minted as usual."""
        message = dict(script[min(tool_turns_done, len(script) - 1)])
        calls = []
        for j, (name, args) in enumerate(message.pop("calls")):
            call_id = self.model.call_id
            calls.append({
                "id": call_id(name, 2 * tool_turns_done + j) if call_id else f"call_{_h(self.seed, h, j) % 16**8:08x}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            })
        if calls:
            message["tool_calls"] = calls
        return message

    def _message(self, h: int, tool_turns_done: int, script_len: int,
                 tools: tuple[OfferedTool, ...]) -> dict[str, Any]:
        words = [_WORDS[(h >> (3 * i)) % len(_WORDS)] for i in range(6 + h % 7)]
        reasoning = " ".join(words).capitalize() + "."
        if tool_turns_done < script_len and tools:
            calls = []
            for j in range(1 + (h >> 40) % 2):
                name, params = tools[(h >> (44 + 2 * j)) % len(tools)]
                args = arguments_for(params, h >> (50 + 2 * j))
                call_id = self.model.call_id
                calls.append(
                    {
                        "id": call_id(name, 2 * tool_turns_done + j) if call_id else
                        f"call_{_h(self.seed, h, j) % 16**8:08x}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                )
            return {"role": "assistant", "content": "", "reasoning_content": reasoning,
                    "tool_calls": calls}
        answer = " ".join(_WORDS[(h >> (2 * i + 7)) % len(_WORDS)] for i in range(4 + h % 5))
        return {"role": "assistant", "content": f"Done: {answer}.", "reasoning_content": reasoning}

    def _resegment(self, ids: list[int], key: bytes) -> list[int]:
        """Split some tokens into smaller ones that decode to the same bytes."""
        assert self.model.splitter is not None
        out: list[int] = []
        for pos, t in enumerate(ids):
            parts = self.model.splitter(t) if _h(self.seed, key, "split", pos) % 3 == 0 else None
            out.extend(parts if parts else [t])
        return out

    def plan(self, prefix: np.ndarray, turn_starts: np.ndarray, seed: int | None = None,
             session: str | None = None) -> tuple[list[int], dict[str, Any]]:
        """Planned ids (through EOT) of the turn that follows `prefix`; `turn_starts`:
        where each turn of the context began to be sampled (`_turn_starts`); `seed`: the
        effective seed (`_seed_of`; None: the server's); `session`: the request's session
        (whose script it plays, `script_owner`)."""
        seed = self.seed if seed is None else seed
        key = _digest(prefix)
        scripted, owner = self.script_owner(session)
        slot = (key, seed, owner)
        cached = self._plans.get(slot)
        if cached is not None:
            return cached
        first = int(turn_starts[0]) if len(turn_starts) else len(prefix)
        episode = _digest(prefix[:first])
        episode_h = _h(self.seed, episode)
        script_len = 1 + episode_h % 3
        tool_turns_done = max(0, len(turn_starts) - 1)
        h = _h(seed, key)
        if scripted:
            message = self._scripted(self._scripts[owner], h, tool_turns_done)
        else:
            message = self._message(h, tool_turns_done, script_len, self._offered(episode, prefix[:first]))
        try:
            ids = list(self.model.render(message))
        except Exception:
            # Some templates (Llama 3.1) render one tool call per turn: script one instead.
            if len(message.get("tool_calls") or ()) < 2:
                raise
            message = {**message, "tool_calls": message["tool_calls"][:1]}
            ids = list(self.model.render(message))
        if len(ids) <= 1:
            # The template drops reasoning and tool calls (Llama 3): say it in content.
            message = {"role": "assistant", "content": message["reasoning_content"]}
            ids = list(self.model.render(message))
        if self.noncanonical:
            ids = self._resegment(ids, key)
        if len(self._plans) > 4096:
            self._plans.clear()
        self._plans[slot] = (ids, message)
        return ids, message

    def _offered(self, episode: bytes, first_prompt: np.ndarray) -> tuple[OfferedTool, ...]:
        """The tools the episode's first prompt offers (the template renders them there:
        system prompt or first user message), decoded once per episode."""
        tools = self._tools.get(episode)
        if tools is None:
            if len(self._tools) > 1024:
                self._tools.clear()
            tools = self._tools[episode] = offered_tools(self.model.decode(first_prompt.tolist()))
        return tools

    def _seed_of(self, request_seed: int | None) -> int:
        """The seed a request draws with: the server's, or the request's mixed into it."""
        return self.seed if request_seed is None else _h(self.seed, "request-seed", request_seed)

    def _plan_holding(self, key: bytes, already: np.ndarray,
                      owner: str | None) -> tuple[list[int], dict[str, Any]] | None:
        """A plan drawn for this prefix under any seed whose head is `already` (a partial
        resubmitted under another seed: see the module doc), among the plans of the
        request's own script `owner` (another session's script never answers it);
        O(plans) on that path only."""
        n = len(already)
        for (k, _, o), (ids, message) in self._plans.items():
            if k == key and o == owner and n <= len(ids) and np.array_equal(already, ids[:n]):
                return ids, message
        return None

    def _turn_starts(self, ctx: np.ndarray) -> np.ndarray:
        """Sorted positions right after each generation prompt (and each resume point)."""
        gp, resume = self.model.generation_prompt_ids, self.model.resume_ids
        starts = _occurrences(ctx, gp) + len(gp)
        if resume:
            starts = np.union1d(starts, _occurrences(ctx, resume) + len(resume))
        return starts

    def start(self, context: Sequence[int], constrained: str | None = None, seed: int | None = None,
              session: str | None = None) -> Cursor:
        """`constrained`: the text a constraint forces (sim/constrained.py), then EOS;
        `seed`: the request's own seed (None: the server's); `session`: the request's
        session, as the server tags it (`x-tito-session`), for its script."""
        eff = self._seed_of(seed)
        ctx = np.asarray(context, dtype=np.int64)
        starts = self._turn_starts(ctx)
        turn_start = int(starts[-1]) if len(starts) else len(ctx)
        prefix = ctx[:turn_start]
        if constrained is not None and self.model.encode is not None:
            message: dict[str, Any] = {}
            planned = [*self.model.encode(constrained), self.model.eos_ids[0]]
        else:
            planned, message = self.plan(prefix, starts, eff, session)
        already = ctx[turn_start:]
        n = len(already)
        diverged = n > len(planned) or (n > 0 and not np.array_equal(already, planned[:n]))
        if diverged and constrained is None and (
                held := self._plan_holding(_digest(prefix), already, self.script_owner(session)[1])) is not None:
            (planned, message), diverged = held, False
        if constrained is not None:
            # a real engine's grammar matcher starts at the first *output* token: ids already
            # in the prompt (a resubmitted partial) are context, and the grammar begins again
            n, diverged = 0, False
        return Cursor(
            planned=planned,
            offset=n,
            diverged=diverged,
            key=_digest(prefix),
            seed=eff,
            eos=self.model.eos_ids[0],
            vocab_size=self.model.vocab_size,
            message=message,
        )


def _scripted_message(turn: Any, k: int) -> dict[str, Any]:
    """One validated script turn as an assistant message; its calls kept as (name, args)
    under "calls" until `_scripted` mints their ids."""
    if not isinstance(turn, dict):
        raise ValueError(f"script turn {k} must be an object, not {type(turn).__name__}")
    content, reasoning = turn.get("content", ""), turn.get("reasoning_content")
    if not isinstance(content, str) or not (reasoning is None or isinstance(reasoning, str)):
        raise ValueError(f"script turn {k}: content and reasoning_content must be strings")
    calls = []
    for c in turn.get("tool_calls") or ():
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("arguments", {}), dict):
            raise ValueError(f"script turn {k}: a tool call is {{name: str, arguments: object}}")
        calls.append((c["name"], c.get("arguments", {})))
    message: dict[str, Any] = {"role": "assistant", "content": content, "calls": calls}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message
