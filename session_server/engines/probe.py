"""Detect which engine protocol a URL speaks, and parse `sglang=URL` / `vllm=URL` specs.

SGLang answers `/get_model_info` (or `/get_server_info` in other builds); vLLM answers
`/v1/models` but not those. SGLang also serves `/v1/models`, so it is tried first.
Whether a vLLM server has the token-in endpoint is probed by `VLLMAdapter.probe`.
"""

from __future__ import annotations

import msgspec

from session_server.engines.http import make_session, request_bytes
from session_server.errors import EngineError, UpstreamInvalid

__all__ = ["PROTOCOLS", "detect_protocol", "parse_engine_spec"]

PROTOCOLS = ("sglang", "vllm")


def parse_engine_spec(spec: str) -> tuple[str | None, str]:
    """`"sglang=http://h:1"` -> ("sglang", url); a bare URL -> (None, url) (detect)."""
    head, sep, rest = spec.partition("=")
    if sep and head in PROTOCOLS:
        return head, rest.rstrip("/")
    if sep and "://" not in head:
        raise ValueError(f"unknown engine protocol {head!r} in {spec!r}; use one of {PROTOCOLS}")
    return None, spec.rstrip("/")


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
