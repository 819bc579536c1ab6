"""Tracing's switch: off by default, on with an OTLP endpoint (flag, TITO_ or the standard
OTEL_ variable), refused at start with one clear line when the OpenTelemetry packages
are missing, and a server without them serves turns while tracing is off."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from session_server.lifecycle import AppConfig, open_tracing
from session_server.ops import cli
from session_server.settings import Settings
from session_server.tracing import TracingUnavailable, check_available, traces_url

from ..stack import CHAT, live_stack

_OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.sdk.trace", "opentelemetry.trace", "opentelemetry.exporter",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                 "opentelemetry.trace.propagation.tracecontext")


@pytest.fixture
def no_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenTelemetry packages as if not installed: importing any of them fails."""
    for name in list(sys.modules):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.trace")):
            monkeypatch.delitem(sys.modules, name)
    for name in _OTEL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


def test_tracing_is_off_by_default_and_on_with_the_standard_otlp_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("TITO_OTEL_ENDPOINT", raising=False)
    assert Settings().otel_endpoint is None
    assert open_tracing(AppConfig(tokenizer="x")) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "rollouts")
    s = Settings()
    assert s.otel_endpoint == "http://127.0.0.1:4318" and s.otel_service_name == "rollouts"
    assert Settings(otel_endpoint="http://c:4318/").otel_endpoint == "http://c:4318/"
    with pytest.raises(ValueError, match="http"):
        Settings(otel_endpoint="collector:4318")
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_serve_has_the_otel_flags() -> None:
    args = cli.build_parser().parse_args(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3",
                                          "--otel-endpoint", "http://127.0.0.1:4318",
                                          "--otel-service-name", "rl"])
    s = cli.settings_from_args(args)
    assert s.otel_endpoint == "http://127.0.0.1:4318" and s.otel_service_name == "rl"


@pytest.mark.usefixtures("no_otel")
def test_tracing_on_without_the_packages_refuses_to_start_with_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import uvicorn

    started: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.append(app))
    rc = cli.main(["serve", "--engine", "sglang=http://127.0.0.1:9", "--tokenizer", "qwen3",
                   "--otel-endpoint", "http://127.0.0.1:4318"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not started
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("session-server serve: error: tracing is on") and "[otel]" in err
    with pytest.raises(TracingUnavailable):
        check_available()
    with pytest.raises(TracingUnavailable):  # an embedding app stops at its start too
        open_tracing(AppConfig(tokenizer="x", settings=Settings(otel_endpoint="http://127.0.0.1:4318")))


@pytest.mark.usefixtures("no_otel")
async def test_a_server_without_the_packages_serves_turns_with_tracing_off(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        r = await st.chat(sid, CHAT, headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        assert r.status_code == 200, r.text
        assert (await st.engine_log())[0]["trace_headers"] == {}
