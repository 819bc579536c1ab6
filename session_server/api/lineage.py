"""A turn's lineage (`trajectory.lineage.Lineage`): which agent and thread asked for it,
read from what the client sends.

Observed on the wire (a throwaway capture middleware in front of this server and the
simulated engine, each CLI's whole request headers and body):

- Claude Code 2.1.197 (`claude -p`, Anthropic Messages): every request carries
  `x-claude-code-session-id: <uuid>` and `metadata.user_id`, a JSON string
  `{"device_id", "account_uuid", "session_id"}` with the same session id; a sub-agent's
  requests (its Agent tool) add `x-claude-code-agent-id: <hex id>` (and
  `cc_is_subagent=true` in the first system block's billing line); the main agent's
  have no agent id.
- Codex 0.169.0 (`codex exec`, Responses): `session-id` and `thread-id` headers (the
  thread's uuid), `x-codex-window-id: <thread>:<n>`, `x-codex-turn-metadata`, a JSON
  object with `agent_name` ("/root" for the main agent), `thread_id`, `thread_source`,
  `request_kind` ("turn"), and the same in the body's `client_metadata`;
  `prompt_cache_key` = the thread id. `x-openai-subagent` (Codex's name for a review,
  compaction or spawned thread's request, in its source) was not seen: a sub-agent
  spawn needs the `multi_agent_v1` namespace tools, which this server does not offer
  a model (function tools only), so it is read as documented there, unverified.

Precedence, first match wins (`source` names what was read):
1. the client's own labels `x-tito-agent`, `x-tito-thread` (+ `x-tito-parent`,
   `x-tito-agent-kind`): any client, any dialect;
2. `x-claude-code-agent-id`: a Claude Code sub-agent (parent: its session id);
3. `x-openai-subagent`: a Codex sub-agent or side request (`compact` is a side request);
4. `x-codex-turn-metadata`: `agent_name` "/root" is the main agent, any other a sub-agent;
5. `x-claude-code-session-id`, `thread-id`, `session-id`: the main agent's thread;
6. body fields the dialect read: Anthropic `metadata.user_id` (its `session_id` when it
   is Claude Code's JSON), `prompt_cache_key` (Responses and chat).

An `x-tito-*` header must be printable ASCII within its bound, else the turn is a 400
naming the header (before any work). Every other header, body field and field inside
Codex's JSON header is a harness's (or a proxy's) own: one that is malformed is
skipped, not refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from trajectory.lineage import KINDS, Lineage

from ..errors import BadRequest
from ..turn.chat_request import ChatRequest

__all__ = ["HEADERS", "MAX_VALUE", "attach", "from_headers"]

MAX_VALUE = 256
"""The longest agent name, thread or parent id kept (a uuid is 36)."""
_MAX_JSON = 8192  # x-codex-turn-metadata (about 700 bytes seen)

AGENT, THREAD, PARENT, KIND = "x-tito-agent", "x-tito-thread", "x-tito-parent", "x-tito-agent-kind"
CLAUDE_AGENT, CLAUDE_SESSION = "x-claude-code-agent-id", "x-claude-code-session-id"
OPENAI_SUBAGENT, CODEX_META = "x-openai-subagent", "x-codex-turn-metadata"
HEADERS = (AGENT, THREAD, PARENT, KIND, CLAUDE_AGENT, CLAUDE_SESSION, OPENAI_SUBAGENT, "thread-id", "session-id",
           "session_id", CODEX_META)
_SIDE_SUBAGENTS = frozenset({"compact"})  # Codex's compaction request summarises; it is no agent's loop


def _printable(v: str, limit: int) -> bool:
    return 0 < len(v) <= limit and all(" " <= c <= "~" for c in v)


_OURS = frozenset({AGENT, THREAD, PARENT, KIND})


def _header(headers: Mapping[str, str], name: str, limit: int = MAX_VALUE) -> str | None:
    """A header's value. Ours (`x-tito-*`), malformed, is the client's 400; another's
    (a harness's or a proxy's: `session-id` is a common name) is skipped, since a
    label we only read along must never fail a turn."""
    v = headers.get(name)
    if v is None:
        return None
    if not _printable(v, limit):
        if name in _OURS:
            raise BadRequest(f"header {name}: must be 1 to {limit} printable ASCII characters")
        return None
    return v


def _codex_meta(raw: str | None) -> dict[str, str]:
    """The string fields of Codex's turn metadata that are well-formed ({} otherwise)."""
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(v, str) and _printable(v, MAX_VALUE)}


def from_headers(headers: Mapping[str, str]) -> Lineage | None:
    """The lineage the headers give (see the module doc); BadRequest names a bad header.
    O(headers): runs on the loop before the body is read."""
    h = {name: _header(headers, name, _MAX_JSON if name == CODEX_META else MAX_VALUE) for name in HEADERS}
    meta = _codex_meta(h[CODEX_META])
    thread = h["thread-id"] or meta.get("thread_id")
    if h[AGENT] is not None or h[THREAD] is not None:
        agent = h[AGENT] or "main"
        kind = h[KIND] or ("main" if agent == "main" else "subagent")
        if kind not in KINDS:
            raise BadRequest(f"header {KIND}: must be one of {', '.join(KINDS)}")
        return Lineage(agent, kind, h[THREAD], h[PARENT], AGENT if h[AGENT] is not None else THREAD)
    if h[KIND] is not None or h[PARENT] is not None:
        raise BadRequest(f"header {KIND if h[KIND] is not None else PARENT}: needs {AGENT} or {THREAD} beside it")
    if (agent_id := h[CLAUDE_AGENT]) is not None:
        return Lineage(agent_id, "subagent", agent_id, h[CLAUDE_SESSION], CLAUDE_AGENT)
    if (sub := h[OPENAI_SUBAGENT]) is not None:
        kind = "side" if sub in _SIDE_SUBAGENTS else "subagent"
        return Lineage(sub, kind, thread, meta.get("parent_thread_id"), OPENAI_SUBAGENT)
    if (name := meta.get("agent_name")) is not None:
        main = name == "/root"
        return Lineage("main" if main else name, "main" if main else "subagent", thread,
                                     None if main else meta.get("parent_thread_id"), CODEX_META)
    for name in (CLAUDE_SESSION, "thread-id", "session-id", "session_id"):
        if (v := h[name]) is not None:
            return Lineage("main", "main", v, None, name)
    return None


def _from_hints(hints: Mapping[str, str]) -> Lineage | None:
    """The body's fields, when the headers said nothing."""
    user_id = hints.get("metadata.user_id")
    if user_id is not None:
        thread: str | None = user_id
        try:
            parsed = json.loads(user_id)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            sid = parsed.get("session_id")
            thread = sid if isinstance(sid, str) else None
        if thread is not None and _printable(thread, MAX_VALUE):
            return Lineage("main", "main", thread, None, "metadata.user_id")
    key = hints.get("prompt_cache_key")
    if key is not None and _printable(key, MAX_VALUE):
        return Lineage("main", "main", key, None, "prompt_cache_key")
    return None


def attach(req: ChatRequest, found: Lineage | None) -> ChatRequest:
    """Set the parsed request's lineage: the headers' when they gave one, else the
    body's fields (runs in the parse, on the offload threads)."""
    req._lineage = found if found is not None else _from_hints(req._lineage_hints)
    return req
