"""The admission check of an engine (`POST /engines`, `--engine`): parse `sglang=URL` /
`vllm=URL` specs, detect the protocol a URL speaks, and verify it really serves it.

Detection: SGLang answers `/get_model_info` (or `/get_server_info` in other builds);
vLLM answers `/v1/models` but not those. SGLang also serves `/v1/models`, so it is
tried first. Verification is each adapter's `prove_protocol`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec

from session_server.engines.http import make_session, request_bytes
from session_server.errors import (
    EngineError,
    UpstreamInvalid,
    UpstreamTimeout,
    UpstreamTransportError,
)

if TYPE_CHECKING:
    from session_server.engines.base import EngineAdapter

__all__ = ["PROTOCOLS", "EngineRefused", "check_engine_spec", "detect_protocol", "parse_engine_spec", "verify_engine"]

PROTOCOLS = ("sglang", "vllm")


def parse_engine_spec(spec: str) -> tuple[str | None, str]:
    """`"sglang=http://h:1"` -> ("sglang", url); a bare URL -> (None, url) (detect)."""
    head, sep, rest = spec.partition("=")
    if sep and head in PROTOCOLS:
        return head, rest.rstrip("/")
    if sep and "://" not in head:
        raise ValueError(f"unknown engine protocol {head!r} in {spec!r}; use one of {PROTOCOLS}")
    return None, spec.rstrip("/")


def check_engine_spec(spec: str) -> str:
    """An engine address as `[sglang=|vllm=]http(s)://host[:port][/path]`, else ValueError
    naming what is wrong: checked where an address enters (POST /engines, `--engine`), so
    a typo is refused there, not an unreachable engine (502) later. Whitespace and control
    characters are refused anywhere: no URL holds them unescaped (RFC 3986), and urlsplit
    would keep a host like `a b` that no resolver knows."""
    bad = next((c for c in spec if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"engine URL {spec!r} contains {bad!r}: no whitespace or control characters")
    head, sep, rest = spec.partition("=")
    address = rest if sep and "://" not in head else spec  # the protocol name is checked by parse_engine_spec
    parts = urlsplit(address)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine URL {spec!r}: expected [sglang=|vllm=]http(s)://host[:port]")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise ValueError(f"engine URL {spec!r}: bad port: {exc}") from None
    return spec


async def detect_protocol(base_url: str, *, timeout_s: float = 5.0) -> str:
    """"sglang" or "vllm"; raises an EngineError when the URL is unreachable or neither."""
    base_url = base_url.rstrip("/")
    session = make_session()
    try:
        for path, protocol in (
            ("/get_model_info", "sglang"),
            ("/get_server_info", "sglang"),
            ("/v1/models", "vllm"),
        ):
            reply = await request_bytes(
                session, "GET", base_url + path, engine=base_url, timeout_s=timeout_s
            )
            if reply.status != 200:
                continue
            try:
                data = msgspec.json.decode(reply.body)
            except msgspec.DecodeError:
                continue
            if isinstance(data, dict):
                return protocol
    except EngineError:
        raise
    finally:
        await session.close()
    raise UpstreamInvalid(f"{base_url} is neither an SGLang nor a vLLM server", engine=base_url)


class EngineRefused(Exception):
    """The URL answers, but not as the declared protocol: it must not be admitted."""


async def verify_engine(adapter: EngineAdapter, *, timeout_s: float = 10.0) -> None:
    """Prove `adapter`'s URL speaks its declared protocol before it takes traffic.

    What proves it is the adapter's own (`EngineAdapter.prove_protocol`); no generation
    is sent, so engine request logs hold only real turns. Unreachable (transport errors,
    timeouts) propagates as the EngineError it is, so a caller can still add an engine
    that is not up yet as unhealthy; anything else is `EngineRefused` saying what was wrong."""
    try:
        await asyncio.wait_for(adapter.prove_protocol(), timeout_s)
    except (UpstreamTransportError, UpstreamTimeout, TimeoutError):
        raise
    except EngineRefused:
        raise
    except EngineError as exc:
        raise EngineRefused(f"{adapter.base_url} does not answer as {adapter.protocol}: {exc}") from exc
