"""OpenTelemetry traces of turns: one span tree per turn, off by default.

Why here, in the foundation: the pipeline (turn), the pause state machine (control) and
the API edge each add to the same turn's tree, and all may import this module; the
OpenTelemetry packages are imported only when tracing is on (`Tracing.open`), so a
server without them installed runs as long as tracing stays off.

The tree of one turn (names and attributes follow the OpenTelemetry GenAI semantic
conventions as of semconv 1.44.0, the `gen_ai_attributes` of
opentelemetry-semantic-conventions 0.66b2; GenAI conventions are still "Development"):

    chat {model}         SERVER  gen_ai.operation.name=chat, gen_ai.conversation.id=<session id>,
                                 gen_ai.request.*, gen_ai.response.*, gen_ai.usage.*
      parse, claim, prepare, render, route        INTERNAL, one per phase
      generate                                    INTERNAL
        segment                                   CLIENT, one per engine request (a pause that
                                                  aborts a turn resubmits it as a new segment)
      validate, commit, respond                   INTERNAL

The phase spans are cut at the boundaries the pipeline already times (`pipeline._Timer`,
the `tito_turn_phase_seconds` histogram): a phase span is written once its phase has
ended, with the timer's own start and end, so tracing adds no clock of its own. Only
`generate` (the parent of the segments) and the turn's root are open while they run.

W3C trace context: the client's `traceparent` / `tracestate` headers are the root's
parent (`Tracing.turn`); each segment's own context goes to the engine as the same two
headers, which SGLang (`tokenizer_manager._trace_request_start`: `extract_trace_headers
(request.headers)`, with `--enable-trace`) and vLLM (`vllm/tracing.py` TRACE_HEADERS,
read from the OpenAI server's request headers, with `--otlp-traces-endpoint`) continue.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

__all__ = ["SCHEMA_URL", "TRACE_HEADERS", "SegmentSpan", "Tracing", "TracingUnavailable", "TurnTrace",
           "check_available", "request_attributes"]

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context (www.w3.org/TR/trace-context)
SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
_INSTALL = "pip install 'tito-session-server[otel]'"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but the OpenTelemetry packages it needs are not installed."""


def check_available(otlp: bool = True) -> None:
    """Raise `TracingUnavailable` (a message saying what to install) unless the SDK, and
    with `otlp` its OTLP/HTTP exporter, can be imported."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        if otlp:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"tracing is on (--otel-endpoint / OTEL_EXPORTER_OTLP_ENDPOINT) but OpenTelemetry is not installed "
            f"({exc}); install it with {_INSTALL}, or unset the endpoint") from None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a base endpoint, as the OTLP exporter spec builds it from
    OTEL_EXPORTER_OTLP_ENDPOINT (`{base}/v1/traces`); a URL already naming it is kept."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def request_attributes(
    model: str | None, *, max_tokens: int, temperature: float | None, top_p: float | None, top_k: int | None,
    seed: int | None, stop: Sequence[str], presence_penalty: float | None, frequency_penalty: float | None,
) -> dict[str, Any]:
    """The `gen_ai.request.*` attributes of a turn's effective sampling (those set)."""
    attrs: dict[str, Any] = {"gen_ai.request.max_tokens": max_tokens}
    for key, value in (("model", model), ("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                       ("seed", seed), ("presence_penalty", presence_penalty),
                       ("frequency_penalty", frequency_penalty)):
        if value is not None:
            attrs[f"gen_ai.request.{key}"] = value
    if stop:
        attrs["gen_ai.request.stop_sequences"] = list(stop)
    return attrs


class Tracing:
    """The process's tracer (its own provider: never the global one, so two apps in one
    process, as in the tests, each keep their spans), built once at start when on."""

    def __init__(self, provider: Any, tracer: Any, propagator: Any) -> None:
        self.provider, self.tracer, self.propagator = provider, tracer, propagator

    @classmethod
    def open(cls, *, endpoint: str | None, service_name: str, instance_id: str | None,
             exporter: Any = None) -> Tracing:
        """Spans to `exporter` as each ends (tests, embedding), else batched to the OTLP/HTTP
        `endpoint`. `TracingUnavailable` when the packages are missing."""
        check_available(otlp=exporter is None)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attrs = {"service.name": service_name}
        if instance_id is not None:
            attrs["service.instance.id"] = instance_id
        provider = TracerProvider(resource=Resource.create(attrs))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            assert endpoint is not None
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        tracer = provider.get_tracer("session_server", schema_url=SCHEMA_URL)
        return cls(provider, tracer, TraceContextTextMapPropagator())

    def turn(self, headers: Mapping[str, str], session_id: str, dialect: str) -> TurnTrace:
        """A turn's root span, a child of the client's trace context when its headers carry one."""
        carrier = {k: v for k in TRACE_HEADERS if (v := headers.get(k)) is not None}
        parent = self.propagator.extract(carrier) if carrier else None
        return TurnTrace(self, parent, session_id, dialect)

    def shutdown(self) -> None:
        """Flush what is batched and stop (at the server's shutdown; blocking, bounded by the SDK)."""
        self.provider.shutdown()


class TurnTrace:
    """One turn's spans. The pipeline's timer hands it each phase's start and end
    (`lap`, perf_counter seconds); the endpoint ends it (`finish` or `fail`)."""

    def __init__(self, tracing: Tracing, parent: Any, session_id: str, dialect: str) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._tracing, self._tracer = tracing, tracing.tracer
        self._set = set_span_in_context
        self._off = time.time_ns() - time.perf_counter_ns()  # perf_counter -> epoch ns
        self._last = time.perf_counter()
        self.root = self._tracer.start_span(
            "chat", context=parent, kind=SpanKind.SERVER, start_time=self._ns(self._last),
            attributes={"gen_ai.operation.name": "chat", "gen_ai.conversation.id": session_id,
                        "tito.dialect": dialect})
        self._ctx = set_span_in_context(self.root)
        self.generate: Any = None
        self._generate_ctx: Any = None

    def _ns(self, t: float) -> int:
        return self._off + int(t * 1e9)

    def lap(self, phase: str, start: float, end: float) -> None:
        """A phase ended: its span, from the timer's start to its end. `route` ending opens
        `generate` (the parent of the segments), which `generate` ending closes."""
        self._last = end
        if phase == "generate" and self.generate is not None:
            self.generate.end(end_time=self._ns(end))
            self.generate = None
            return
        span = self._tracer.start_span(phase, context=self._ctx, start_time=self._ns(start))
        span.end(end_time=self._ns(end))
        if phase == "route":
            self.generate = self._tracer.start_span("generate", context=self._ctx, start_time=self._ns(end))
            self._generate_ctx = self._set(self.generate)

    def request(self, attrs: Mapping[str, Any]) -> None:
        """The turn's request attributes (`request_attributes`); names the root `chat {model}`."""
        self.root.set_attributes(attrs)
        model = attrs.get("gen_ai.request.model")
        if model:
            self.root.update_name(f"chat {model}")

    def segment(self, index: int, request_id: str, engine: str) -> SegmentSpan:
        """One engine request of the turn, a child of `generate` (of the root, if none is open)."""
        return SegmentSpan(self, self._generate_ctx if self.generate is not None else self._ctx,
                           index, request_id, engine)

    def finish(self, *, response_id: str, finish_reason: str, input_tokens: int, output_tokens: int,
               cached_tokens: int | None, turn_index: int, branch_id: int) -> None:
        """The response went out: `respond` (from the last phase's end to now) and the root."""
        now = time.perf_counter()
        self.lap("respond", self._last, now)
        attrs: dict[str, Any] = {
            "gen_ai.response.id": response_id, "gen_ai.response.finish_reasons": [finish_reason],
            "gen_ai.usage.input_tokens": input_tokens, "gen_ai.usage.output_tokens": output_tokens,
            "tito.turn.index": turn_index, "tito.turn.branch_id": branch_id,
        }
        if cached_tokens:
            attrs["gen_ai.usage.cache_read.input_tokens"] = cached_tokens
        self.root.set_attributes(attrs)
        self.root.end(end_time=self._ns(now))

    def fail(self, exc: BaseException) -> None:
        """The turn failed: the open spans end with status ERROR and `error.type`."""
        from opentelemetry.trace import Status, StatusCode

        end = self._ns(time.perf_counter())
        kind = type(exc).__name__
        for span in (self.generate, self.root):
            if span is not None:
                span.set_attribute("error.type", kind)
                span.set_status(Status(StatusCode.ERROR, str(exc)[:500] or kind))
        if self.generate is not None:
            self.generate.end(end_time=end)
            self.generate = None
        self.root.record_exception(exc)
        self.root.end(end_time=end)


class SegmentSpan:
    """One engine request (`control/resilient.py`): `headers` carry its context to the
    engine; used as a context manager around the request, an exception marks it ERROR."""

    __slots__ = ("headers", "span")

    def __init__(self, trace: TurnTrace, parent: Any, index: int, request_id: str, engine: str) -> None:
        from opentelemetry.trace import SpanKind

        self.span = trace._tracer.start_span(
            "segment", context=parent, kind=SpanKind.CLIENT,
            attributes={"tito.segment.index": index, "tito.segment.request_id": request_id, "tito.engine": engine})
        self.headers: dict[str, str] = {}
        trace._tracing.propagator.inject(self.headers, context=trace._set(self.span))

    def result(self, finish_reason: str, output_tokens: int) -> None:
        """What the engine answered (`abort`: a pause cut it; the turn goes on in the next segment)."""
        self.span.set_attributes({"tito.segment.finish_reason": finish_reason,
                                  "tito.segment.output_tokens": output_tokens})

    def __enter__(self) -> SegmentSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("error.type", type(exc).__name__)
            self.span.set_status(Status(StatusCode.ERROR, str(exc)[:500] or type(exc).__name__))
        self.span.end()
