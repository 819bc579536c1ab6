"""A Python client for the session server: sync (`SessionClient`) and async (`AsyncSessionClient`).

For rollout workers, trainers and tests: create sessions, run turns, pause and
resume the engines, read trajectories, attach rewards and fetch training samples
straight into numpy (`trajectory.samples.Sample`). Agents themselves talk to a
session with any OpenAI client: `openai_base_url(sid)` is its ``base_url`` and
`session_token(sid)` its ``api_key`` (when the server has auth on).

Both clients share one implementation: `_Calls` builds each request as a `_Call`
(method, path, query, JSON body, headers, and how to decode the reply), and
`_Call.decode` turns an `httpx.Response` into the result; the two clients differ
only in whether they `await` the transport. So a request means the same thing,
and fails the same way, from sync and async code.

**Errors.** Any non-2xx reply raises `SessionServerError` with the HTTP status
and the ``type``/``message`` of the server's envelope ``{"error": {"type",
"message"}}`` (``type`` ``http_error`` when the body is not one, e.g. a proxy's
page). ``207`` (a partial pause/resume) is a success: its report says what
failed. Transport failures (connection refused, timeouts) are httpx's own
exceptions.

**Auth** (`session_server.auth`). With ``admin_token`` every request carries
``Authorization: Bearer <admin_token>``. Without it, the client sends the
session token minted by `create_session` on that session's agent routes
(``/sessions/{sid}/v1/...``, i.e. `chat`), which is all a session token is good
for; other routes then go without a credential (fine when auth is off).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import httpx
import orjson

from trajectory.sample_formats import load_samples_json, load_samples_npz, load_samples_safetensors
from trajectory.samples import DEFAULT_PICKER, Sample

SampleFormat = Literal["json", "npz", "safetensors"]
SAMPLE_LOADERS: dict[str, Callable[[bytes], list[Sample]]] = {
    "json": load_samples_json,
    "npz": load_samples_npz,
    "safetensors": load_samples_safetensors,
}
DEFAULT_TIMEOUT_S = 600.0  # a turn may generate for minutes; the server bounds turns itself


class SessionServerError(Exception):
    """A non-2xx reply: HTTP `status`, the envelope's `type` and `message`."""

    def __init__(self, status: int, type: str, message: str, *, retry_after: str | None = None) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.retry_after = retry_after  # the Retry-After header, when the server sent one


def error_from_response(resp: httpx.Response) -> SessionServerError:
    """Our envelope when the body is one, else ``http_error`` with the start of the body."""
    kind, message = "http_error", resp.text[:500] or resp.reason_phrase
    try:
        err = orjson.loads(resp.content).get("error")
        if isinstance(err, dict) and isinstance(err.get("type"), str):
            kind, message = err["type"], str(err.get("message", ""))
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return SessionServerError(resp.status_code, kind, message, retry_after=resp.headers.get("retry-after"))


def _json_body(resp: httpx.Response) -> Any:
    return orjson.loads(resp.content)


def _no_body(resp: httpx.Response) -> None:
    return None


def _raw_body(resp: httpx.Response) -> bytes:
    return resp.content


@dataclass(frozen=True, slots=True)
class _Call:
    """One request, transport-free: what to send and how to read the reply."""

    method: str
    path: str
    decode_body: Callable[[httpx.Response], Any]
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    after: Callable[[Any], None] | None = None  # bookkeeping on success (session tokens)

    def decode(self, resp: httpx.Response) -> Any:
        if not 200 <= resp.status_code < 300:
            raise error_from_response(resp)
        out = self.decode_body(resp)
        if self.after is not None:
            self.after(out)
        return out

    def kwargs(self) -> dict[str, Any]:
        """Arguments of `httpx.Client.request` / `httpx.AsyncClient.request`."""
        out: dict[str, Any] = {"params": self.params or None, "headers": self.headers or None}
        if self.json is not None:
            out["content"] = orjson.dumps(self.json)
            out["headers"] = {"content-type": "application/json", **self.headers}
        return out


def _sid(session_id: str) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
    return quote(session_id, safe="")


def _sample_format(fmt: str) -> str:
    if fmt not in SAMPLE_LOADERS:
        raise ValueError(f"format must be one of {sorted(SAMPLE_LOADERS)}, got {fmt!r}")
    return fmt


def _samples_decoder(fmt: str) -> Callable[[httpx.Response], list[Sample]]:
    load = SAMPLE_LOADERS[fmt]
    return lambda resp: load(resp.content)


def _samples_query(picker: str, max_seq_len: int | None, fmt: str, agent: str | None = None,
                   agent_kind: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"format": _sample_format(fmt), "picker": picker}
    if max_seq_len is not None:
        out["max_seq_len"] = max_seq_len
    if agent is not None:  # the agent filter (docs/api.md, sub-agent lineage)
        out["agent"] = agent
    if agent_kind is not None:
        out["agent_kind"] = agent_kind
    return out


class _Calls:
    """Request building shared by both clients (and the session tokens they learn)."""

    def __init__(self, admin_token: str | None) -> None:
        self.admin_token = admin_token
        self.tokens: dict[str, str] = {}  # session id -> its token, from create_session

    def _auth(self, session_id: str | None = None) -> dict[str, str]:
        token = self.admin_token or (self.tokens.get(session_id) if session_id else None)
        return {"authorization": f"Bearer {token}"} if token else {}

    def _remember(self, body: Any) -> None:
        if isinstance(body, dict) and isinstance(body.get("api_key"), str):
            self.tokens[str(body["session_id"])] = body["api_key"]

    def _forget(self, session_ids: Sequence[str]) -> Callable[[Any], None]:
        def forget(_: Any) -> None:
            for sid in session_ids:
                self.tokens.pop(sid, None)

        return forget

    def create_session(self, options: Mapping[str, Any]) -> _Call:
        return _Call("POST", "/sessions", _json_body, json=dict(options), headers=self._auth(), after=self._remember)

    def chat(self, session_id: str, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> _Call:
        if params.get("stream"):
            raise ValueError("chat() returns one completion; stream with an OpenAI client on openai_base_url()")
        body = {**params, "messages": list(messages)}
        return _Call("POST", f"/sessions/{_sid(session_id)}/v1/chat/completions", _json_body, json=body,
                     headers=self._auth(session_id))

    def session(self, session_id: str) -> _Call:
        return _Call("GET", f"/sessions/{_sid(session_id)}", _json_body, headers=self._auth())

    def trajectory(self, session_id: str, fmt: str) -> _Call:
        if fmt not in ("json", "npz"):
            raise ValueError(f"format must be 'json' or 'npz', got {fmt!r}")
        return _Call("GET", f"/sessions/{_sid(session_id)}/trajectory", _json_body if fmt == "json" else _raw_body,
                     params={"format": fmt}, headers=self._auth())

    def close(self, session_id: str) -> _Call:
        return _Call("DELETE", f"/sessions/{_sid(session_id)}", _no_body, headers=self._auth(),
                     after=self._forget([session_id]))

    def pause(self, mode: str, lora: str | None) -> _Call:
        body: dict[str, Any] = {"mode": mode} if lora is None else {"mode": mode, "lora": lora}
        return _Call("POST", "/control/pause", _json_body, json=body, headers=self._auth())

    def resume(self, lora: str | None) -> _Call:
        return _Call("POST", "/control/resume", _json_body, json={} if lora is None else {"lora": lora},
                     headers=self._auth())

    def control_state(self) -> _Call:
        return _Call("GET", "/control/state", _json_body, headers=self._auth())

    def set_weight_version(self, version: int, force: bool) -> _Call:
        return _Call("POST", "/control/weight_version", _json_body, json={"version": version, "force": force},
                     headers=self._auth())

    def samples(self, session_id: str, picker: str, max_seq_len: int | None, fmt: str, agent: str | None = None,
                agent_kind: str | None = None) -> _Call:
        query = _samples_query(picker, max_seq_len, fmt, agent, agent_kind)
        return _Call("GET", f"/sessions/{_sid(session_id)}/samples", _samples_decoder(fmt), params=query,
                     headers=self._auth())

    def set_reward(self, session_id: str, reward: float | None, metadata: Mapping[str, Any] | None,
                   leaf: int | None, turn: int | None = None) -> _Call:
        if reward is not None and (isinstance(reward, bool) or not math.isfinite(reward)):
            raise ValueError(f"reward must be a finite number or None, got {reward!r}")
        body: dict[str, Any] = {"reward": reward}
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if leaf is not None:
            body["leaf"] = leaf
        if turn is not None:
            body["turn"] = turn
        return _Call("POST", f"/sessions/{_sid(session_id)}/reward", _json_body, json=body, headers=self._auth())

    def batch_samples(self, session_ids: Sequence[str], close: bool, picker: str, max_seq_len: int | None,
                      fmt: str, agent: str | None = None, agent_kind: str | None = None) -> _Call:
        if isinstance(session_ids, str):
            raise ValueError("session_ids must be a list of session ids, not one str")
        body = {"session_ids": list(session_ids), "close": close,
                **_samples_query(picker, max_seq_len, fmt, agent, agent_kind)}
        return _Call("POST", "/samples", _samples_decoder(fmt), json=body, headers=self._auth(),
                     after=self._forget(body["session_ids"]) if close else None)

    def health(self) -> _Call:
        return _Call("GET", "/health", _json_body)


class _Base:
    """Construction and the transport-free helpers of both clients."""

    def __init__(self, base_url: str, admin_token: str | None) -> None:
        self.base_url = str(base_url).rstrip("/")
        self._calls = _Calls(admin_token)

    def openai_base_url(self, session_id: str) -> str:
        """The session's OpenAI ``base_url``: give it to the agent's client."""
        return f"{self.base_url}/sessions/{_sid(session_id)}/v1"

    def session_token(self, session_id: str) -> str | None:
        """The session's token (the agent's ``api_key`` when auth is on), if this client created it."""
        return self._calls.tokens.get(session_id)


class SessionClient(_Base):
    """Blocking client (httpx.Client). Use as a context manager, or call `disconnect()`."""

    def __init__(self, base_url: str, *, admin_token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 http: httpx.Client | None = None) -> None:
        super().__init__(base_url, admin_token)
        self._owned = http is None
        self._http = http if http is not None else httpx.Client(base_url=self.base_url, timeout=timeout)

    def _run(self, call: _Call) -> Any:
        return call.decode(self._http.request(call.method, call.path, **call.kwargs()))

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

    def disconnect(self) -> None:
        """Release the connections (only when this client made its httpx.Client)."""
        if self._owned:
            self._http.close()

    def health(self) -> dict[str, Any]:
        return dict(self._run(self._calls.health()))

    def create_session(self, **options: Any) -> str:
        """POST /sessions with `options` (metadata, ttl_s, sampling, chat_template_kwargs,
        history_policy, max_context_tokens, lora, max_weight_lag, sampling_policy, seed); returns the
        session id."""
        return str(self._run(self._calls.create_session(options))["session_id"])

    def chat(self, session_id: str, messages: Sequence[Mapping[str, Any]], **params: Any) -> dict[str, Any]:
        """One turn: POST /sessions/{sid}/v1/chat/completions; the OpenAI completion as a dict."""
        return dict(self._run(self._calls.chat(session_id, messages, params)))

    def session(self, session_id: str) -> dict[str, Any]:
        return dict(self._run(self._calls.session(session_id)))

    def trajectory(self, session_id: str, format: Literal["json", "npz"] = "json") -> Any:
        """The exported tree: a dict for ``json``, the raw bytes for ``npz``."""
        return self._run(self._calls.trajectory(session_id, format))

    def close(self, session_id: str) -> None:
        """DELETE the session (its samples are gone afterwards: fetch them first)."""
        self._run(self._calls.close(session_id))

    def pause(self, mode: Literal["abort", "keep", "wait"] = "abort", *, lora: str | None = None) -> dict[str, Any]:
        """POST /control/pause; the report (``ok`` False on a partial pause, HTTP 207)."""
        return dict(self._run(self._calls.pause(mode, lora)))

    def resume(self, *, lora: str | None = None) -> dict[str, Any]:
        return dict(self._run(self._calls.resume(lora)))

    def control_state(self) -> dict[str, Any]:
        return dict(self._run(self._calls.control_state()))

    def set_weight_version(self, version: int, *, force: bool = False) -> dict[str, Any]:
        return dict(self._run(self._calls.set_weight_version(version, force)))

    def samples(self, session_id: str, *, picker: str = DEFAULT_PICKER, max_seq_len: int | None = None,
                format: SampleFormat = "safetensors", agent: str | None = None,
                agent_kind: str | None = None) -> list[Sample]:
        """GET /sessions/{sid}/samples, loaded into `Sample`s (numpy arrays); `agent` /
        `agent_kind` keep the lines holding that agent's turns and train only those."""
        return list(self._run(self._calls.samples(session_id, picker, max_seq_len, format, agent, agent_kind)))

    def set_reward(self, session_id: str, reward: float | None, *, metadata: Mapping[str, Any] | None = None,
                   leaf: int | None = None, turn: int | None = None) -> dict[str, Any]:
        """POST /sessions/{sid}/reward: for every kept leaf, only `leaf`, or only the turn
        whose seq is `turn` (its per-turn reward)."""
        return dict(self._run(self._calls.set_reward(session_id, reward, metadata, leaf, turn)))

    def batch_samples(self, session_ids: Sequence[str], *, close: bool = False, picker: str = DEFAULT_PICKER,
                      max_seq_len: int | None = None, format: SampleFormat = "safetensors", agent: str | None = None,
                      agent_kind: str | None = None) -> list[Sample]:
        """POST /samples: the samples of many sessions in one payload, optionally closing them."""
        return list(self._run(self._calls.batch_samples(session_ids, close, picker, max_seq_len, format, agent,
                                                        agent_kind)))


class AsyncSessionClient(_Base):
    """Asyncio client (httpx.AsyncClient); the same methods as `SessionClient`, awaited."""

    def __init__(self, base_url: str, *, admin_token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 http: httpx.AsyncClient | None = None) -> None:
        super().__init__(base_url, admin_token)
        self._owned = http is None
        self._http = http if http is not None else httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    async def _run(self, call: _Call) -> Any:
        return call.decode(await self._http.request(call.method, call.path, **call.kwargs()))

    async def __aenter__(self) -> AsyncSessionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

    async def disconnect(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def health(self) -> dict[str, Any]:
        return dict(await self._run(self._calls.health()))

    async def create_session(self, **options: Any) -> str:
        return str((await self._run(self._calls.create_session(options)))["session_id"])

    async def chat(self, session_id: str, messages: Sequence[Mapping[str, Any]], **params: Any) -> dict[str, Any]:
        return dict(await self._run(self._calls.chat(session_id, messages, params)))

    async def session(self, session_id: str) -> dict[str, Any]:
        return dict(await self._run(self._calls.session(session_id)))

    async def trajectory(self, session_id: str, format: Literal["json", "npz"] = "json") -> Any:
        return await self._run(self._calls.trajectory(session_id, format))

    async def close(self, session_id: str) -> None:
        await self._run(self._calls.close(session_id))

    async def pause(self, mode: Literal["abort", "keep", "wait"] = "abort", *,
                    lora: str | None = None) -> dict[str, Any]:
        return dict(await self._run(self._calls.pause(mode, lora)))

    async def resume(self, *, lora: str | None = None) -> dict[str, Any]:
        return dict(await self._run(self._calls.resume(lora)))

    async def control_state(self) -> dict[str, Any]:
        return dict(await self._run(self._calls.control_state()))

    async def set_weight_version(self, version: int, *, force: bool = False) -> dict[str, Any]:
        return dict(await self._run(self._calls.set_weight_version(version, force)))

    async def samples(self, session_id: str, *, picker: str = DEFAULT_PICKER, max_seq_len: int | None = None,
                      format: SampleFormat = "safetensors", agent: str | None = None,
                      agent_kind: str | None = None) -> list[Sample]:
        return list(await self._run(self._calls.samples(session_id, picker, max_seq_len, format, agent, agent_kind)))

    async def set_reward(self, session_id: str, reward: float | None, *, metadata: Mapping[str, Any] | None = None,
                         leaf: int | None = None, turn: int | None = None) -> dict[str, Any]:
        return dict(await self._run(self._calls.set_reward(session_id, reward, metadata, leaf, turn)))

    async def batch_samples(self, session_ids: Sequence[str], *, close: bool = False, picker: str = DEFAULT_PICKER,
                            max_seq_len: int | None = None, format: SampleFormat = "safetensors",
                            agent: str | None = None, agent_kind: str | None = None) -> list[Sample]:
        return list(await self._run(self._calls.batch_samples(session_ids, close, picker, max_seq_len, format,
                                                              agent, agent_kind)))
