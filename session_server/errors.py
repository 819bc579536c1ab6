"""Every error the service can answer with, and the one map to HTTP status.

    ServiceError                         (status, type)
    ├── BadRequest                       400 invalid_request (also FastAPI's own validation)
    │   ├── HistoryMismatch              400 history_mismatch (cannot reconcile messages)
    │   └── TemplateError                400 template_error (the chat template refused the input)
    ├── Unauthorized                     401 unauthorized
    ├── SessionNotFound                  404 session_not_found
    ├── SessionGone                      410 session_gone (closed, expired or taken by samples close; a tombstone)
    ├── NotFound                         404 not_found (unknown engine id, unknown route)
    ├── MethodNotAllowed                 405 method_not_allowed
    ├── SessionBusy                      409 session_busy    Retry-After: 2
    ├── SessionClosed                    409 session_closed
    ├── PauseSuperseded                  409 pause_superseded (a resume or another pause came between a wait's drain and its freeze)
    ├── PayloadTooLarge                  413 payload_too_large
    ├── StreamOverflow                   503 stream_overflow (only an SSE error event: the client stopped reading)
    ├── WrongInstance                    421 wrong_instance (the session id names another instance)
    ├── IdempotencyKeyReused             422 idempotency_key_reused (same Idempotency-Key, other body)
    ├── OverCapacity                     429 over_capacity   Retry-After: 5
    ├── BranchLimit                      429 branch_limit    Retry-After: 60 (names the cap)
    ├── TooManyViewers                   429 too_many_viewers  Retry-After: 10 (the viewer's live streams are capped)
    ├── ClientGone                       499 client_gone (client disconnected mid-turn; logged, never sent)
    ├── InternalInvariant                500 internal_error (logged at ERROR)
    │   └── CommittedUnanswered          500 response_failed  x-should-retry: false (committed; the response failed)
    ├── EngineError                      502 upstream_error (engine side; adapters raise these)
    │   ├── UpstreamInvalid              502 upstream_invalid (bad engine output)
    │   ├── UpstreamHTTPError            502 upstream_error (engine 4xx/5xx; `.http_status`)
    │   ├── UpstreamTransportError       502 upstream_unreachable (connect/reset; `.transient`)
    │   ├── UpstreamTimeout              504 upstream_timeout
    │   └── EngineAborted                503 engine_aborted  Retry-After: 1 (abort with nothing to resume)
    ├── NoHealthyEngine                  503 no_healthy_engine  Retry-After: 5
    ├── InstanceUnavailable              503 instance_unavailable  Retry-After: 5 (a peer instance is down or failed)
    ├── ReplyWorkerLost                  503 reply_worker_lost  Retry-After: 1 (the reply worker died with the turn's request: nothing committed)
    ├── PausedTooLong                    503 paused          Retry-After: 10 (deadline passed while paused)
    ├── JournalUnavailable               503 journal_unavailable  Retry-After: 10 (the journal cannot be written: nothing committed)
    ├── Recovering                       503 recovering      Retry-After: 1 (the journal is being replayed at start-up)
    └── DrainTimeout                     504 drain_timeout (a wait pause's turns outlived the drain: no engine paused)

`from_http_status` builds a plain `ServiceError` with type `http_error` for any other
framework-level status. `tests/fast/foundation/test_errors_tree.py` keeps this drawing
equal to the classes.

`details` (None: none) are extra top-level fields of the error body: a pause that failed
sends its report there beside the envelope. `from_peer` rebuilds the error a peer
instance answered (its status, type and message) for the trainer.

`retry_after_s` (None: no header) is a class attribute; the app's one error handler
sends it as `Retry-After` (whole seconds) so clients back off instead of hammering.

`trajectory.errors.ValidationError` maps to UpstreamInvalid at the turn pipeline;
`trajectory.errors.CodecError` raised while serving a request maps to TemplateError
and `SampleError` (a bad samples request) to BadRequest (`from_library`); at start-up
`TemplateNotSupported` stops the server instead.
"""

from __future__ import annotations

from trajectory.errors import CodecError, SampleError


def _rebuild(cls: type[ServiceError], message: str, state: dict[str, object]) -> ServiceError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class ServiceError(Exception):
    status: int = 500
    type: str = "internal_error"
    retry_after_s: int | None = None  # sent as the Retry-After header when set
    should_retry: bool | None = None  # sent as x-should-retry when set (the SDKs and Claude Code obey it)
    details: dict[str, object] | None = None  # extra top-level body fields (a failed pause's report)

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.type)
        self.message = message or self.type

    def __reduce__(self) -> tuple[object, ...]:
        # keep keyword-only attributes (engine, http_status, transient) across a
        # process boundary: engine replies may be decoded in a worker process
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def to_body(self) -> dict[str, object]:
        return {"error": {"type": self.type, "message": self.message}, **(self.details or {})}


class BadRequest(ServiceError):
    status, type = 400, "invalid_request"


class HistoryMismatch(BadRequest):
    type = "history_mismatch"


class TemplateError(BadRequest):
    type = "template_error"


class Unauthorized(ServiceError):
    status, type = 401, "unauthorized"


class SessionNotFound(ServiceError):
    status, type = 404, "session_not_found"


class SessionGone(ServiceError):
    """The session existed here and was closed, expired or taken by `POST /samples` with
    `close` (a journal tombstone, kept for a bounded time). Neither SDK retries a 410
    (they retry 408, 409, 429 and 5xx), so an agent stops instead of hammering."""

    status, type = 410, "session_gone"


class NotFound(ServiceError):
    status, type = 404, "not_found"


class MethodNotAllowed(ServiceError):
    status, type = 405, "method_not_allowed"


class SessionBusy(ServiceError):
    """A turn is already in flight on the session. Both SDKs retry a 409 and honour
    `Retry-After` (openai / anthropic `_base_client.py`: `_should_retry` retries 409,
    `_calculate_retry_timeout` reads `retry-after-ms` / `retry-after` up to 60 s); without
    it they back off 0.5 s, 1 s: likely still busy. 2 s covers a short agent turn."""

    status, type = 409, "session_busy"
    retry_after_s = 2


class SessionClosed(ServiceError):
    status, type = 409, "session_closed"


class PauseSuperseded(ServiceError):
    """A cluster `wait` pause drained, but before its engines were paused a resume (or
    another pause) reopened or changed the gate here: nothing was frozen."""

    status, type = 409, "pause_superseded"


class PayloadTooLarge(ServiceError):
    status, type = 413, "payload_too_large"


class StreamOverflow(ServiceError):
    """A streamed response's client stopped reading and its unsent frames passed
    `stream_buffer_bytes`: its stream ends with this error event (never an HTTP status:
    the response has begun). The turn itself runs on and commits."""

    status, type = 503, "stream_overflow"


class WrongInstance(ServiceError):
    """The session id's prefix names another instance of the cluster: the
    proxy in front routed it here by mistake. 421 Misdirected Request, so it is never
    mistaken for "this session is gone"; nothing here was created or touched."""

    status, type = 421, "wrong_instance"


class IdempotencyKeyReused(ServiceError):
    """An `Idempotency-Key` already named another request body on this session and route:
    a key identifies one request (IETF draft-ietf-httpapi-idempotency-key-header: 422)."""

    status, type = 422, "idempotency_key_reused"


class OverCapacity(ServiceError):
    status, type = 429, "over_capacity"
    retry_after_s = 5


class BranchLimit(ServiceError):
    """A retry or fork would create more branches than `max_branches` allows."""

    status, type = 429, "branch_limit"
    retry_after_s = 60


class TooManyViewers(ServiceError):
    """A session's (or this process's) live viewer streams are at their cap (api/ui_data.py)."""

    status, type = 429, "too_many_viewers"
    retry_after_s = 10


class ClientGone(ServiceError):
    """The client disconnected mid-turn: the turn was cancelled and nothing committed.

    499 (nginx's "client closed request") is only logged and counted: nobody is
    left to receive it."""

    status, type = 499, "client_gone"


class InternalInvariant(ServiceError):
    status, type = 500, "internal_error"


class CommittedUnanswered(InternalInvariant):
    """The turn was committed, then its response could not be built (a bug: the message
    every dialect renders is checked before the commit). Retrying cannot help and must not
    sample the turn again: `x-should-retry: false`, and a replay gets this same error
    (idempotency.py) while the turn stays in the trajectory."""

    type = "response_failed"
    should_retry = False
    turn: tuple[int, int] | None = None  # (branch id, turn index) of the committed turn


class EngineError(ServiceError):
    """Raised by engine adapters; `engine` names the base URL."""

    status, type = 502, "upstream_error"

    def __init__(self, message: str = "", *, engine: str = "") -> None:
        super().__init__(message)
        self.engine = engine


class UpstreamInvalid(EngineError):
    type = "upstream_invalid"


class UpstreamHTTPError(EngineError):
    def __init__(self, message: str = "", *, engine: str = "", http_status: int = 0) -> None:
        super().__init__(message, engine=engine)
        self.http_status = http_status


class UpstreamTransportError(EngineError):
    """Connection refused/reset/closed. `transient` is True when retrying is safe
    (nothing reached the engine or nothing was produced)."""

    type = "upstream_unreachable"

    def __init__(self, message: str = "", *, engine: str = "", transient: bool = True) -> None:
        super().__init__(message, engine=engine)
        self.transient = transient


class UpstreamTimeout(EngineError):
    status, type = 504, "upstream_timeout"


class EngineAborted(EngineError):
    status, type = 503, "engine_aborted"
    retry_after_s = 1


class NoHealthyEngine(ServiceError):
    status, type = 503, "no_healthy_engine"
    retry_after_s = 5


class ReplyWorkerLost(ServiceError):
    """The reply worker process (engines/reply_worker.py) died while it made or parsed
    this turn's engine request: nothing was committed, and it says nothing of the
    engine (not an `EngineError`: routing health must not count it)."""

    status, type = 503, "reply_worker_lost"
    retry_after_s = 1


class InstanceUnavailable(ServiceError):
    """Another instance of the cluster, needed for this request (the owner of a session
    in a samples batch), is down, did not answer in time, or failed: nothing was sent."""

    status, type = 503, "instance_unavailable"
    retry_after_s = 5


class PausedTooLong(ServiceError):
    status, type = 503, "paused"
    retry_after_s = 10


class JournalUnavailable(ServiceError):
    """The journal could not store a change (a full disk, an I/O error): the change was
    not made, so a client never holds an answer that a crash could take back."""

    status, type = 503, "journal_unavailable"
    retry_after_s = 10


class Recovering(ServiceError):
    """The instance is replaying its journal: sessions come back in a moment."""

    status, type = 503, "recovering"
    retry_after_s = 1


class DrainTimeout(ServiceError):
    """A `wait` pause's in-flight turns did not all finish within the drain timeout. No
    engine was paused (a frozen turn would go on under the new weights), the gate stays
    closed; `details` is the pause report (which instances, how many turns left)."""

    status, type = 504, "drain_timeout"


ECHO_CHARS = 64


def shown(value: object) -> str:
    """A client-supplied value (a session id, a response id) as an error message quotes it:
    its repr, cut to `ECHO_CHARS` characters + "…", so a 60 KB id is not echoed back whole."""
    text = str(value)
    return repr(text) if len(text) <= ECHO_CHARS else repr(text[:ECHO_CHARS]) + "…"


def from_library(exc: Exception) -> ServiceError | None:
    """The service error a `trajectory` library error means at the HTTP edge (None: unmapped).

    The codec renders what the client sent (messages, tools, template kwargs): when
    the template refuses it, that is the client's input, a 400 naming the reason."""
    if isinstance(exc, CodecError):
        return TemplateError(str(exc))
    if isinstance(exc, SampleError):  # an unknown picker, a bad max_seq_len or reward
        return BadRequest(str(exc))
    return None


_BY_STATUS: dict[int, type[ServiceError]] = {
    400: BadRequest, 401: Unauthorized, 404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge,
}


def from_peer(status: int, body: object) -> ServiceError:
    """The error a peer instance answered (our envelope), as this instance's own: its
    known types keep their class, anything else its status and type; a peer's 5xx or a
    reply that is not our envelope means the peer failed (503 instance_unavailable)."""
    err = body.get("error") if isinstance(body, dict) else None
    if status >= 500 or not isinstance(err, dict):
        return InstanceUnavailable(f"a peer instance answered {status}: {str(body)[:300]}")
    kind, message = str(err.get("type", "http_error")), str(err.get("message", ""))
    for cls in (SessionNotFound, SessionBusy, SessionClosed, WrongInstance, BadRequest, Unauthorized, NotFound):
        if cls.type == kind and cls.status == status:
            return cls(message)
    out = ServiceError(message)
    out.status, out.type = status, kind
    return out


def from_http_status(status: int, detail: str) -> ServiceError:
    """A framework HTTP error (unknown route, wrong method, ...) in our envelope."""
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls(detail)
    err = ServiceError(detail)
    err.status, err.type = status, "http_error"
    return err
