"""Cluster-wide control: relay a control request to the other instances.

N `serve` processes share the engines and no state: a trainer sends `pause`, `resume`,
`weight_version` and engine changes to any one of them, which applies the request
locally and relays the same body to every peer (`Settings.peers`) at once. A relayed
request carries `x-tito-relayed: 1`, so a peer applies it locally and relays nothing
(no loops, whatever the peer lists say). A peer's answer is one entry of the report's
`instances`; the route answers 200 only when every instance acknowledged, else 207
with `failed_instances` naming each one that did not (down, timed out, refused).

Relayed requests pass the peer's auth like any other: they carry the admin token
this instance is configured with, else the `Authorization` header it received.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

__all__ = ["RELAYED_HEADER", "PeerRelay", "merge_instances"]

log = logging.getLogger(__name__)

RELAYED_HEADER = "x-tito-relayed"
_ACK = frozenset({200, 201, 204})
_REPORTED = frozenset({207, 409, 504})  # answers whose body carries the peer's report


class PeerRelay:
    """The peers of this instance and one HTTP client to reach them (opened on first use)."""

    def __init__(self, peers: Sequence[str], *, timeout_s: float, admin_token: str | None = None) -> None:
        self.peers = tuple(peers)
        self.timeout_s = timeout_s
        self.admin_token = admin_token
        self._http: aiohttp.ClientSession | None = None
        self._instances: dict[str, str] | None = None  # instance id -> peer URL (`instances`)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._http

    def wanted(self, headers: Any) -> bool:
        """Relay this request? Not when there are no peers or it is itself a relay."""
        return bool(self.peers) and headers.get(RELAYED_HEADER) is None

    async def send(
        self, method: str, path: str, body: bytes = b"", *, authorization: str | None = None,
        absent_ok: bool = False, timeout_s: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """`method path body` on every peer concurrently; one outcome per peer URL.

        `absent_ok`: a 404 counts as acknowledged (a DELETE of what a peer does not have).
        `timeout_s`: this call's limit when it may take longer than `self.timeout_s`
        (a drain). A peer that refused the connection is `unreachable`: it is down."""
        headers = self._headers(authorization)
        outcomes = await asyncio.gather(
            *(self._one(peer, method, path, body, headers, absent_ok, timeout_s) for peer in self.peers))
        return dict(zip(self.peers, outcomes, strict=True))

    async def _one(
        self, peer: str, method: str, path: str, body: bytes, headers: dict[str, str], absent_ok: bool,
        timeout_s: float | None,
    ) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        try:
            async with self._session().request(method, peer + path, data=body or None, headers=headers,
                                               timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("control relay %s %s to %s failed: %r", method, path, peer, exc)
            failed: dict[str, Any] = {"ok": False, "status": None,
                                      "error": f"{type(exc).__name__}: {exc}".rstrip(": ")}
            if isinstance(exc, aiohttp.ClientConnectorError):
                failed["unreachable"] = True
            return failed
        reply = _json_or_text(raw)
        if status in _ACK or (absent_ok and status == 404):
            out: dict[str, Any] = {"ok": True, "status": status}
            if status == 404:
                out["absent"] = True
            elif reply is not None:
                out["report"] = reply
            return out
        log.warning("control relay %s %s to %s answered %d", method, path, peer, status)
        out = {"ok": False, "status": status}
        if status in _REPORTED:
            out["report"] = reply  # the peer's report: its engines failed, or its pause did not complete
        if status != 207:
            out["error"] = _error_text(reply, status)
        return out

    async def fetch(self, path: str, *, timeout_s: float, misses: dict[str, str] | None = None) -> dict[str, Any]:
        """`GET path` on every peer concurrently: its JSON body where it answered 200,
        else None (down, refused, timed out): a peer sync reads the cluster's state.

        A peer that does not answer is expected (workers of a cluster start together,
        and the first up finds the others not yet listening): it is logged at DEBUG, and
        its reason in a few words goes into `misses` for the caller's one summary line."""
        headers = {RELAYED_HEADER: "1"}
        if self.admin_token:
            headers["authorization"] = f"Bearer {self.admin_token}"
        async def one(peer: str) -> Any:
            try:
                async with self._session().get(peer + path, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    if resp.status != 200:
                        reason = f"answered {resp.status}"
                    else:
                        return orjson.loads(await resp.read())
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
                reason = short_reason(exc)
            log.debug("peer %s: GET %s: %s", peer, path, reason)
            if misses is not None:
                misses.setdefault(peer, reason)
            return None

        outcomes = await asyncio.gather(*(one(peer) for peer in self.peers))
        return dict(zip(self.peers, outcomes, strict=True))

    def _headers(self, authorization: str | None) -> dict[str, str]:
        headers = {RELAYED_HEADER: "1", "content-type": "application/json"}
        auth = f"Bearer {self.admin_token}" if self.admin_token else authorization
        if auth:
            headers["authorization"] = auth
        return headers

    async def post(self, peer: str, path: str, body: bytes, *,
                   authorization: str | None = None) -> tuple[int, bytes]:
        """One relayed `POST` to one peer: its status and body. Raises the transport's
        error (`aiohttp.ClientError`, `TimeoutError`): the caller says what it means."""
        async with self._session().post(peer + path, data=body, headers=self._headers(authorization)) as resp:
            return resp.status, await resp.read()

    async def instances(self, *, refresh: bool = False) -> tuple[dict[str, str], list[str]]:
        """Which peer URL is which instance (`/health` names it): ({instance: url}, the
        peers that did not answer). Cached once every peer answered; `refresh` asks again."""
        if self._instances is None or refresh:
            health = await self.fetch("/health", timeout_s=min(10.0, self.timeout_s))
            found = {str(h["instance_id"]): peer for peer, h in health.items()
                     if isinstance(h, dict) and isinstance(h.get("instance_id"), str)}
            silent = [peer for peer in self.peers if peer not in found.values()]
            if silent:
                return found, silent
            self._instances = found
        return self._instances, []

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


def short_reason(exc: BaseException) -> str:
    """Why a peer did not answer, in a few words (aiohttp's repr of a refused connect is
    three hundred characters of connection key)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({os_error.strerror or type(os_error).__name__})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, orjson.JSONDecodeError):
        return "answered no JSON"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"
    return type(exc).__name__


def _json_or_text(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:500].decode("utf-8", "replace")


def _error_text(reply: Any, status: int) -> str:
    """Our envelope's message, else the body (shortened), else the status."""
    if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
        err = reply["error"]
        return f"{status} {err.get('type', '')}: {err.get('message', '')}".strip()
    return f"{status}: {reply}" if reply else f"HTTP {status}"


def merge_instances(report: dict[str, Any], instances: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """The local report with every peer's outcome: `instances`, `failed_instances`, and
    `ok` (all engines here and every instance acknowledged); 200 when ok, else 207."""
    failed = sorted(peer for peer, out in instances.items() if not out["ok"])
    ok = bool(report.get("ok", True)) and not failed
    return {**report, "ok": ok, "instances": instances, "failed_instances": failed}, 200 if ok else 207
