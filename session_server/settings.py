"""The server's settings: one typed model that the environment and the CLI fill.

Every field is an environment variable `TITO_<FIELD>` (e.g. `TITO_MAX_SESSIONS`) and a
`serve` flag `--<field-with-dashes>` built from this model (`cli.py`), so a default is
written once, here. Precedence: a flag given on the command line, then the environment,
then the default below. A bad value is one `ValidationError` naming the field.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trajectory.codec.families import GENERIC, ours_names

from .journal_file import SYNC_MODES
from .malloc_tuning import MAX_RETAIN_MB
from .routing.factory import POLICY_NAMES
from .sessions import INSTANCE_ID, SAMPLING_POLICIES

__all__ = ["ADMIN_TOKEN_ENV", "ENV_PREFIX", "Settings"]

ENV_PREFIX = "TITO_"
ADMIN_TOKEN_ENV = "SESSION_SERVER_ADMIN_TOKEN"  # the older name, still read
# the families our own codecs serve, for --template-family's help (the family registry's)
_OUR_FAMILIES = ", ".join(n for n in ours_names() if n != GENERIC)


CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "routing_policy": ("routing policy", tuple(POLICY_NAMES)),
    "sampling_policy": ("sampling policy", tuple(SAMPLING_POLICIES)),
    "journal_sync": ("journal sync", tuple(SYNC_MODES)),
}
"""The settings that take one of a few words: what each is called in its error, and the
words (the flags offer them as choices: ops/settings_flags.py)."""


class Settings(BaseSettings):
    """Server-wide settings (docs/api.md; `session-server serve --help`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, populate_by_name=True, extra="forbid")

    cpu_workers: int | None = Field(
        None, ge=1, le=256, description="threads for parsing, rendering and serializing off the event loop "
        "(unset: from the CPU count)")
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens of a turn whose request and session set none")
    turn_timeout_s: float = Field(
        600.0, gt=0, description="deadline of one turn, unless the request's timeout_s sets another")
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="largest request body accepted (413 above)")
    stream_buffer_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="SSE bytes one streamed response may have waiting for a client "
        "that does not read (checked as each frame arrives: the backlog may pass it by one frame); past it the "
        "client's stream is cut with a stream_overflow error event (the turn still "
        "commits: a retry with x-stainless-retry-count or Idempotency-Key gets it whole)")
    max_sessions: int = Field(100_000, ge=1, description="live sessions at most (429 over_capacity above)")
    default_ttl_s: float = Field(
        3600.0, gt=0, description="idle time after which a session expires, unless its creation sets ttl_s")
    max_branches: int = Field(
        64, ge=1, description="branches per session at most: a retry or fork past it is refused (429 branch_limit)")
    sweep_interval_s: float = Field(5.0, gt=0, description="how often expired sessions are swept")
    loop_lag_probe_s: float = Field(
        0.25, ge=0, description="how often the event loop's lag is measured into tito_event_loop_lag_seconds "
        "(a timer's lateness; 0: off)")
    busy_wait_s: float = Field(
        300.0, ge=0, description="how long a chat on a session with a turn in flight waits for that turn to end "
        "before it is answered 409 session_busy (harnesses send side requests, e.g. Claude Code's title, "
        "beside their main one); waiting requests are served one at a time in arrival order (0: 409 at once)")
    keepalive_s: float = Field(
        15.0, gt=0, le=300, description="the longest a streamed turn stays silent: a keep-alive each dialect's "
        "clients accept (Anthropic `ping`, OpenAI Responses `response.in_progress`, an SSE comment on chat "
        "completions) goes out after this long without a frame, so client idle watchdogs do not abort "
        "turns held by a pause or a long constrained sample")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="at shutdown, how long in-flight turns may finish: `serve` then cancels those "
        "still running (in whole seconds, rounded down: under 1 cancels at once; a cancelled turn commits nothing "
        "and its engine request is aborted), and closes the engines once no turn holds a session or after this "
        "long again; a `cluster` kills a worker still running this + 5 s after stopping it")
    clamp_logprob_sentinel: bool = Field(
        False, description="turn an engine's -9999 'unavailable' logprob sentinel into -100 and count it (else 502)")
    routing_policy: str = Field("sticky_cost", description=f"how sessions are placed on engines: {', '.join(POLICY_NAMES)}")
    prefill_slots_per_engine: int = Field(1, ge=1, description="large uncached prefills in flight per engine")
    large_prefill_tokens: int = Field(
        16384, ge=1, description="uncached prompt tokens from which a prefill counts as large")
    health_check_interval_s: float = Field(
        2.0, gt=0, description="seconds between active health checks of each engine")
    pause_grace_s: float = Field(
        0.05, ge=0, description="after the gate closes, how long requests already past it get to reach the engine "
        "before the pause fans out")
    pause_drain_timeout_s: float = Field(
        60.0, gt=0, description="how long a wait pause lets in-flight turns finish before it gives up (504 "
        "drain_timeout: no engine paused, the gate stays closed)")
    decode_processes: int = Field(
        1, ge=0, le=64, description="reply worker processes: they parse large engine replies and make the generation "
        "requests known to answer large themselves, so those replies never enter serve (0: none; threads parse "
        "everything, serve makes every request)")
    malloc_retain_mb: int = Field(
        32, ge=0, le=MAX_RETAIN_MB, description="glibc only, in serve and its reply workers: blocks up to 32 MiB come "
        "from the heap and each heap's top keeps up to this many MiB free before it is trimmed, so ~1 MB engine "
        "replies reuse memory instead of growing and trimming the heap; memory held after a burst grows with "
        "it (bench/README.md). 0: the allocator as the environment set it (GLIBC_TUNABLES, MALLOC_*_), which "
        "any other value overrides")
    admin_token: str | None = Field(
        None, validation_alias=AliasChoices(f"{ENV_PREFIX}ADMIN_TOKEN", ADMIN_TOKEN_ENV),
        description=f"turn on bearer auth with this admin token (env {ENV_PREFIX}ADMIN_TOKEN or "
        f"{ADMIN_TOKEN_ENV}; unset: auth off). Prefer the variable: a flag shows in `ps`")
    template_family: str | None = Field(
        None, min_length=1, description=f"force the chat-template family: one of ours ({_OUR_FAMILIES}), a "
        "renderers family (e.g. qwen3.5, glm-5), renderers:NAME, or generic (unset: detected from the "
        "tokenizer's own template, never its name)")
    vocab_size: int | None = Field(
        None, ge=1, description="the model's vocabulary rows, the bound on every sampled id (unset: the "
        "`vocab_size` of the config.json beside the tokenizer, else the tokenizer's own size). Real models "
        "have more rows than their tokenizer has ids (Qwen3: 151,936 for 151,669) and may sample any row")
    replay_grace_s: float = Field(
        10.0, ge=0, description="how long a turn whose client hung up waits for the SDK's retry (a request with "
        "x-stainless-retry-count or Idempotency-Key) before it is cancelled; a retry in time adopts it")
    replay_per_session: int = Field(
        4, ge=0, description="committed responses kept per session to answer replayed requests")
    replay_store_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="bytes of stored responses kept for replays over all sessions "
        "(oldest evicted first)")
    journal_dir: str | None = Field(
        None, min_length=1, description="keep every session change in a journal (SQLite) in this directory, one "
        "file per instance, and replay it at start: sessions survive a crash or restart (unset: sessions live "
        "in memory only)")
    journal_max_bytes: int | None = Field(
        None, ge=65536, description="a quota on the journal file: past it, changes are refused with 503 "
        "journal_unavailable, as on a full disk (unset: the volume's space)")
    journal_sync: str = Field(
        "full", description="with a journal: full syncs it at every commit, so an acknowledged change survives a "
        "crash of the machine; normal syncs it only at checkpoints: a killed process (kill -9, OOM) still loses "
        "nothing acknowledged, a crashed machine may take back the last changes; what skipping the syncs saves "
        "depends on the volume (bench/README.md)")
    tombstone_ttl_s: float = Field(
        3600.0, ge=0, description="with a journal: how long a closed, expired or collected session answers 410 "
        "session_gone instead of 404")
    instance_id: str | None = Field(
        None,
        description="this process's name in a cluster: the prefix of its session ids ({instance}.{32 hex}) "
        "that a proxy routes by, and what /health reports; lowercase letters, digits and inner dashes, "
        "at most 32 (unset: random per start)")
    sglang_incremental_streams: list[str] = Field(
        [], description="base URLs of the SGLang engines started with --incremental-streaming-output, or '*' "
        "for every SGLang engine: their stream frames are deltas, so the viewer watches their turns that the "
        "client does not stream (SGLang's default cumulative frames would cost O(L^2); docs/engines.md)")
    peers: list[str] = Field(
        [], description="base URLs of the other instances of this cluster (`session-server cluster` sets "
        "them): a control-plane request received here is relayed to each; repeat the flag, "
        "or a JSON list in the environment")
    sampling_policy: str = Field(
        "pinned", description="whose sampling values reach the engine unless a session sets sampling_policy: "
        "pinned (the session's; what a client sends is recorded per turn) or client (the request's over the "
        "session's defaults)")
    routing_replay: bool = Field(
        False, description="sessions record the engine's routed experts (R3) unless they set routing_replay")
    routed_experts_topk: int | None = Field(
        None, ge=1, le=1024, description="experts per token of the MoE model: splits SGLang's flat routed-experts "
        "rows into (layers, topk) (vLLM's .npy payload carries its shape)")
    routed_experts_layers: int | None = Field(
        None, ge=1, le=4096, description="MoE layers of the model (an alternative to routed_experts_topk)")
    peer_timeout_s: float = Field(
        120.0, gt=0, description="how long a control request relayed to a peer may take before it counts as failed")
    engine_load_poll_s: float = Field(
        2.0, ge=0, description="seconds between polls of each engine's own load (SGLang /get_load, vLLM /metrics), "
        "which placement of new sessions (and bounded_load's cap, cache_aware's balance test) adds to this "
        "instance's in-flight count (0: off)")
    routed_experts_num_experts: int | None = Field(
        None, ge=1, le=32768, description="experts per layer: routed ids must be below it (unset: not checked)")
    otel_endpoint: str | None = Field(
        None, validation_alias=AliasChoices(f"{ENV_PREFIX}OTEL_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="turn on OpenTelemetry traces of turns, exported over OTLP/HTTP to this collector (a base "
        "URL such as http://127.0.0.1:4318, to which /v1/traces is added; env also the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT). Needs the `otel` extra (unset: no tracing, nothing imported)")
    otel_service_name: str = Field(
        "tito", min_length=1,
        validation_alias=AliasChoices(f"{ENV_PREFIX}OTEL_SERVICE_NAME", "OTEL_SERVICE_NAME"),
        description="the `service.name` of the traces (env also the standard OTEL_SERVICE_NAME)")

    @field_validator("otel_endpoint")
    @classmethod
    def _otel_url(cls, v: str | None) -> str | None:
        if v is not None and not v.strip().startswith(("http://", "https://")):
            raise ValueError(f"the OTLP endpoint must be an http(s) URL, not {v!r}")
        return v.strip() if v is not None else v

    @field_validator(*CHOICES)
    @classmethod
    def _one_of_its_choices(cls, v: str, info: ValidationInfo) -> str:
        what, names = CHOICES[str(info.field_name)]
        if v not in names:
            raise ValueError(f"unknown {what} {v!r}; choose from {', '.join(names)}")
        return v

    @field_validator("sglang_incremental_streams")
    @classmethod
    def _incremental_urls(cls, v: list[str]) -> list[str]:
        bad = [u for u in v if u != "*" and not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"sglang_incremental_streams: http(s) base URLs or '*', not {', '.join(map(repr, bad))}")
        return [u.rstrip("/") for u in v]

    @field_validator("peers")
    @classmethod
    def _peer_urls(cls, v: list[str]) -> list[str]:
        out = [u.strip().rstrip("/") for u in v if u.strip()]
        bad = [u for u in out if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"peers must be http(s) base URLs, not {', '.join(map(repr, bad))}")
        return out

    @field_validator("template_family")
    @classmethod
    def _known_family(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from trajectory.codec.detect import check_family_name
        from trajectory.errors import TemplateNotSupported

        try:
            return check_family_name(v)
        except TemplateNotSupported as exc:
            raise ValueError(str(exc)) from None

    @field_validator("instance_id")
    @classmethod
    def _instance_id_shape(cls, v: str | None) -> str | None:
        if v is not None and not INSTANCE_ID.fullmatch(v):
            raise ValueError(f"instance id {v!r} must be 1-32 lowercase letters, digits or inner dashes "
                             "(it prefixes session ids in URLs, before a '.')")
        return v

    @field_validator("admin_token")
    @classmethod
    def _token_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("the admin token is empty; unset it to run without auth")
        return v

