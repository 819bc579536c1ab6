"""OpenTelemetry traces of turns, through real HTTP and the real OpenAI and Anthropic SDKs:
the span tree of a turn (names, parents, GenAI attributes), the client's W3C trace context
continued, each engine request carrying its segment span's `traceparent` (the simulator's
request log is what the engine received), a turn resubmitted after a pause as two segment
spans, a failed turn's spans in status ERROR, and spans posted to an OTLP/HTTP collector."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from aiohttp import web  # noqa: E402
from anthropic import AsyncAnthropic  # noqa: E402
from openai import APIStatusError, AsyncOpenAI  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from session_server.context import Settings  # noqa: E402
from session_server.ops.harness import free_port, live_apps  # noqa: E402

from ..stack import Stack, live_stack, until_in_flight  # noqa: E402

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
PHASES = ["parse", "claim", "prepare", "render", "route", "generate", "validate", "commit", "respond"]
MSGS = [{"role": "user", "content": "Refactor the config loader and run the tests."}]


def _openai(st: Stack, sid: str, **headers: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0, default_headers=headers)


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def _tree(spans: tuple[ReadableSpan, ...]) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
    """The one turn's root and its spans by name."""
    roots = [s for s in spans if s.name.startswith("chat")]
    assert len(roots) == 1, [s.name for s in spans]
    by_name: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    return roots[0], by_name


def _parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_turn_is_one_span_tree_continuing_the_clients_trace_and_sent_on_to_the_engine(
        qwen3_dir: Path, protocol: str) -> None:
    exporter = InMemorySpanExporter()
    async with live_stack(qwen3_dir, protocol, span_exporter=exporter) as st:
        sid = await st.session(sampling_policy="client")  # the client's sampling is what the engine gets
        async with _openai(st, sid, traceparent=TRACEPARENT, tracestate="congo=t61rcWkgMzE") as client:
            r = await client.chat.completions.create(model="qwen-test", messages=MSGS, max_tokens=24,  # type: ignore[arg-type]
                                                     temperature=0.7, top_p=0.9, seed=11)
        log = await st.engine_log()
    root, spans = _tree(exporter.get_finished_spans())
    assert root.name == "chat qwen-test" and root.kind is SpanKind.SERVER
    # the client's context continued: its trace, its span as the root's parent, its tracestate
    assert root.context.trace_id == int(CLIENT_TRACE, 16)
    assert root.parent is not None and root.parent.span_id == int(CLIENT_SPAN, 16) and root.parent.is_remote
    assert root.context.trace_state.get("congo") == "t61rcWkgMzE"
    a = dict(root.attributes or {})
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.conversation.id"] == sid
    assert a["gen_ai.request.model"] == "qwen-test" and a["gen_ai.request.temperature"] == 0.7
    assert a["gen_ai.request.top_p"] == 0.9 and a["gen_ai.request.seed"] == 11
    assert a["gen_ai.request.max_tokens"] == 24
    assert r.usage is not None and r.choices[0].finish_reason is not None
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == r.usage.completion_tokens
    assert list(a["gen_ai.response.finish_reasons"]) == [r.choices[0].finish_reason]
    assert a["gen_ai.response.id"] and a["tito.dialect"] == "openai_chat"
    assert root.status.status_code is StatusCode.UNSET
    # one span per phase under the root, in the pipeline's order, each inside the turn
    phases = sorted((s for n in PHASES for s in spans[n]), key=lambda s: s.start_time or 0)
    assert [s.name for s in phases] == PHASES
    assert root.start_time is not None and root.end_time is not None
    for s in phases:
        assert _parent_id(s) == root.context.span_id and s.context.trace_id == root.context.trace_id
        assert s.start_time is not None and s.end_time is not None
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time, s.name
    # one segment under generate; the engine received that segment's context
    [gen], [seg] = spans["generate"], spans["segment"]
    assert _parent_id(seg) == gen.context.span_id and seg.kind is SpanKind.CLIENT
    assert seg.attributes is not None and seg.attributes["tito.segment.index"] == 0
    assert seg.attributes["tito.segment.output_tokens"] == r.usage.completion_tokens
    assert len(log) == 1
    sent = log[0]["trace_headers"]
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{_hex(seg.context.span_id, 16)}-01"
    assert sent["tracestate"] == "congo=t61rcWkgMzE"


async def test_an_anthropic_turn_without_client_context_starts_its_own_trace(qwen3_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    async with live_stack(qwen3_dir, span_exporter=exporter) as st:
        sid = await st.session()
        async with AsyncAnthropic(base_url=f"{st.url}/sessions/{sid}", api_key="x", max_retries=0) as client:
            msg = await client.messages.create(model="claude-test", max_tokens=16, messages=MSGS)  # type: ignore[arg-type]
        log = await st.engine_log()
    root, spans = _tree(exporter.get_finished_spans())
    assert root.parent is None and root.name == "chat claude-test"
    a = dict(root.attributes or {})
    assert a["tito.dialect"] == "anthropic_messages" and a["gen_ai.conversation.id"] == sid
    assert a["gen_ai.usage.output_tokens"] == msg.usage.output_tokens
    [seg] = spans["segment"]
    version, trace_id, parent_id, flags = log[0]["trace_headers"]["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", _hex(root.context.trace_id, 32), _hex(seg.context.span_id, 16))
    assert int(flags, 16) & 1  # sampled
    assert "tracestate" not in log[0]["trace_headers"]


async def test_a_turn_resubmitted_after_a_pause_has_a_segment_span_per_engine_request(qwen3_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    async with live_stack(qwen3_dir, latency_ms=4, span_exporter=exporter) as st:
        sid = await st.session()
        chat = asyncio.create_task(st.chat(sid, {"messages": MSGS, "max_tokens": 200}))
        await until_in_flight(st, sid)
        await asyncio.sleep(0.05)
        assert (await st.http.post("/control/pause", json={"mode": "abort"})).json()["ok"]
        await asyncio.sleep(0.03)
        assert (await st.http.post("/control/resume", json={})).status_code == 200
        r = await chat
        assert r.status_code == 200, r.text
        log = await st.engine_log()
    root, spans = _tree(exporter.get_finished_spans())
    [gen] = spans["generate"]
    segs = sorted(spans["segment"], key=lambda s: s.start_time or 0)
    assert len(segs) == 2 == len(log)
    assert [s.attributes["tito.segment.index"] for s in segs if s.attributes] == [0, 1]
    assert [s.attributes["tito.segment.finish_reason"] for s in segs if s.attributes][0] == "abort"
    assert all(_parent_id(s) == gen.context.span_id for s in segs)
    # each engine request carried its own segment's context, under the rid the log names
    for s, req in zip(segs, log, strict=True):
        assert s.attributes is not None and s.attributes["tito.segment.request_id"] == req["rid"]
        assert req["trace_headers"]["traceparent"].split("-")[2] == _hex(s.context.span_id, 16)
    assert root.attributes is not None and root.attributes["gen_ai.usage.output_tokens"] == sum(
        s.attributes["tito.segment.output_tokens"] for s in segs if s.attributes)


async def test_a_failed_turn_ends_its_spans_in_error(qwen3_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    async with live_stack(qwen3_dir, span_exporter=exporter) as st:
        sid = await st.session()
        await st.fault("http_500")
        async with _openai(st, sid, traceparent=TRACEPARENT) as client:
            with pytest.raises(APIStatusError) as failed:
                await client.chat.completions.create(model="m", messages=MSGS, max_tokens=8)  # type: ignore[arg-type]
        assert failed.value.status_code == 502
    root, spans = _tree(exporter.get_finished_spans())
    assert root.context.trace_id == int(CLIENT_TRACE, 16)
    for span in (root, spans["generate"][0], spans["segment"][0]):
        assert span.status.status_code is StatusCode.ERROR, span.name
        assert span.attributes is not None and span.attributes["error.type"], span.name
    assert "validate" not in spans and "commit" not in spans and "respond" not in spans
    assert any(e.name == "exception" for e in root.events)


async def test_tracing_off_sends_the_engine_no_trace_headers(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        async with _openai(st, sid, traceparent=TRACEPARENT) as client:
            await client.chat.completions.create(model="m", messages=MSGS, max_tokens=8)  # type: ignore[arg-type]
        log = await st.engine_log()
        assert live_apps[st.url].state.ctx.tracing is None
    assert log[0]["trace_headers"] == {}


@contextlib.asynccontextmanager
async def _collector() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A local OTLP/HTTP collector: every body POSTed to /v1/traces."""
    bodies: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        bodies.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        await runner.cleanup()


async def test_an_otlp_endpoint_gets_the_turns_spans_over_http(qwen3_dir: Path) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    async with _collector() as (url, bodies):
        settings = Settings(otel_endpoint=url, otel_service_name="tito-test")
        async with live_stack(qwen3_dir, settings=settings) as st:
            sid = await st.session()
            async with _openai(st, sid) as client:
                await client.chat.completions.create(model="m", messages=MSGS, max_tokens=8)  # type: ignore[arg-type]
        # the server's shutdown flushes its batch to the collector
        for _ in range(100):
            if bodies:
                break
            await asyncio.sleep(0.05)
    names: list[str] = []
    service: set[Any] = set()
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            for ss in rs.scope_spans:
                names += [s.name for s in ss.spans]
    assert service == {"tito-test"}
    assert sorted(names) == sorted(["chat m", *PHASES, "segment"])
