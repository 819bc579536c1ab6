"""`verify-template --engine URL`: drive a real (or simulated) engine through our server
and check, per turn, that what the session stores is token-exact with what went over
the wire to the engine and back.

The engine samples what it likes, so nothing here judges content. A recording proxy
sits between our server and the engine (127.0.0.1, free port) and keeps every
generate exchange as raw bytes; the probe conversations (a user turn, a tool call and
its result, parallel calls; reasoning on and off where the template has the switch)
run through our server with the stock `openai` client. For each turn:

- `render0` (first turn): the prompt ids sent == the chat template's own render of the
  request (`apply_chat_template`, not our codec);
- `prefix` (later turns): the prompt ids sent start with the previous turn's prompt ids
  + the ids the engine sampled then (what the model saw and said stays, token for token);
- `prompt`: the prompt ids sent == the session's stored ids before the turn's output;
- `sampled`: the ids the engine answered (read from the raw body by the protocol's
  parser) == the session's stored sampled ids;
- `parse`: the message the server returned == our codec's parse of the stored ids.

A failed check, or a turn the server could not complete, is a hard mismatch (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from trajectory.codec.probe import encode, render_text
from trajectory.codec.verify import TOOLS as TEMPLATE_TOOLS
from trajectory.codec.verify import thinking_plan

from ..loopback import serving_aiohttp

# the template probes' tools (get_weather, search) plus the coding-agent ones the
# simulator's scripted agent calls (a real model may call any of them)
AGENT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": f"{name} in the repository",
                                      "parameters": {"type": "object", "properties": {arg: {"type": "string"}},
                                                     "required": [arg]}}}
    for name, arg in (("read_file", "path"), ("run_shell", "command"))
]
TOOLS: list[dict[str, Any]] = [*TEMPLATE_TOOLS, *AGENT_TOOLS]
CHECKS = ("render0", "prefix", "prompt", "sampled", "parse")
_GENERATE_PATHS = {"/generate": "sglang", "/inference/v1/generate": "vllm-generate",
                   "/v1/completions": "vllm-completions"}
_HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class Exchange:
    """One generate request the server sent and the engine's raw answer."""

    kind: str
    request: dict[str, Any]
    status: int
    body: bytes

    def input_ids(self) -> list[int]:
        key = "input_ids" if self.kind == "sglang" else "token_ids" if self.kind == "vllm-generate" else "prompt"
        return [int(t) for t in self.request.get(key) or ()]

    def output_ids(self) -> list[int]:
        """The sampled ids as the engine sent them (the protocol's own parser)."""
        from ..engines.sglang import parse_sglang_generate
        from ..engines.vllm import parse_vllm_completions, parse_vllm_generate

        parse = {"sglang": parse_sglang_generate, "vllm-generate": parse_vllm_generate,
                 "vllm-completions": parse_vllm_completions}[self.kind]
        return [int(t) for t in parse(self.body, request_id="verify").output_ids]


class RecordingProxy:
    """Forwards every request to the engine unchanged; keeps the generate exchanges."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._client: ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            return await self._send(request, body, headers)
        except ClientError as exc:
            return web.Response(status=502, text=f"verify proxy: engine unreachable: {exc}")

    async def _send(self, request: web.Request, body: bytes, headers: dict[str, str]) -> web.Response:
        assert self._client is not None
        async with self._client.request(request.method, self.target + request.path_qs, data=body,
                                        headers=headers) as resp:
            payload = await resp.read()
            kind = _GENERATE_PATHS.get(request.path)
            if kind is not None and request.method == "POST":
                with contextlib.suppress(ValueError):
                    self.exchanges.append(Exchange(kind, json.loads(body), resp.status, payload))
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            return web.Response(status=resp.status, body=payload, headers=out_headers)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        """Serve on a free 127.0.0.1 port for the duration; yields the proxy's URL."""
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._client = ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False)
        try:
            async with serving_aiohttp(app) as url:
                yield url
        finally:
            await self._client.close()


@dataclass
class EngineStep:
    """One turn of one probe conversation against the engine."""

    scenario: str
    turn: int
    thinking: str
    checks: dict[str, bool] = field(default_factory=dict)  # check -> passed (absent: not applicable)
    detail: list[str] = field(default_factory=list)
    error: str = ""
    sent: int = 0  # prompt ids sent to the engine
    sampled: int = 0  # ids the engine sampled

    @property
    def ok(self) -> bool:
        return not self.error and all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "turn": self.turn, "thinking": self.thinking, "ok": self.ok,
                "checks": dict(self.checks), "detail": list(self.detail), "error": self.error or None,
                "sent": self.sent, "sampled": self.sampled}


@dataclass
class EngineReport:
    """Everything the engine run found; `ok` feeds the exit status."""

    url: str
    steps: list[EngineStep] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.steps) and all(s.ok for s in self.steps)

    @property
    def failures(self) -> list[EngineStep]:
        return [s for s in self.steps if not s.ok]

    def status(self) -> str:
        if self.error:
            return f"FAILED: {self.error}"
        good = sum(s.ok for s in self.steps)
        return f"{good}/{len(self.steps)} turns token-exact" + ("" if self.ok else " (FAILED)")

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "ok": self.ok, "status": self.status(), "error": self.error or None,
                "steps": [s.to_dict() for s in self.steps]}

    def format_lines(self) -> list[str]:
        lines = [f"engine {self.url}: {self.status()}"]
        for s in self.steps:
            marks = " ".join(f"{c}={'ok' if v else 'FAIL'}" for c, v in s.checks.items())
            tag = "ok  " if s.ok else "FAIL"
            lines.append(f"  [{tag}] {s.scenario}[{s.turn}] thinking={s.thinking} ({s.sent}+{s.sampled} ids): "
                         f"{marks or '-'}"
                         + (f" - {s.error}" if s.error else ""))
            lines += [f"         {d}" for d in s.detail]
        return lines


# -- probe conversations ------------------------------------------------------------


def _call(i: str, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def engine_scenarios() -> list[tuple[str, list[dict[str, Any]]]]:
    """(name, the messages of the first request); each is played for two turns."""
    system = {"role": "system", "content": "You are a careful assistant. Use tools when they help."}
    user = {"role": "user", "content": "What is the weather in Paris? Then read README.md."}
    weather = _call("w1", "get_weather", {"city": "Paris", "metric": True, "detailed": False, "date": None,
                                          "days": 3})
    par = [_call("p1", "get_weather", {"city": "Paris"}), _call("p2", "search", {"q": "Paris events"})]
    return [
        ("user", [system, user]),
        ("tool_result", [system, user, {"role": "assistant", "content": "", "tool_calls": [weather]},
                         {"role": "tool", "tool_call_id": "call_w1", "content": '{"temp": 21, "rain": false}'}]),
        ("parallel_tool_calls", [user, {"role": "assistant", "content": "Checking both.", "tool_calls": par},
                                 {"role": "tool", "tool_call_id": "call_p1", "content": "sunny"},
                                 {"role": "tool", "tool_call_id": "call_p2", "content": "a concert"}]),
    ]


# -- the checks ---------------------------------------------------------------------


def _first_diff(a: Sequence[int], b: Sequence[int]) -> str:
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at {k} (lengths {len(a)} vs {len(b)}): {list(a[k:k + 6])} vs {list(b[k:k + 6])}"


def _message_view(msg: Mapping[str, Any]) -> dict[str, Any]:
    """What a parse must give back: content, reasoning and calls (ids are fresh)."""
    calls = []
    for tc in msg.get("tool_calls") or ():
        fn = tc.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = fn.get("arguments")
        calls.append({"name": fn.get("name"), "arguments": args})
    return {"content": msg.get("content") or "", "reasoning_content": msg.get("reasoning_content") or None,
            "tool_calls": calls}


def check_turn(step: EngineStep, ex: Exchange, prev: Exchange | None, stored: Sequence[int],
               turn: Mapping[str, Any], *, render0: list[int] | None, returned: Mapping[str, Any],
               parsed: Mapping[str, Any]) -> None:
    """Fill `step.checks` for one turn (module doc); `stored` is the branch's token ids."""
    sent = ex.input_ids()
    try:
        got = ex.output_ids()
    except Exception as exc:  # the raw body does not parse: the server should not have committed it
        got = []
        step.detail.append(f"sampled: engine body does not parse: {exc}")
    start, end = int(turn["output_start"]), int(turn["output_end"])
    step.sent, step.sampled = len(sent), len(got)

    def check(name: str, want: Sequence[int], have: Sequence[int], what: str) -> None:
        step.checks[name] = list(want) == list(have)
        if not step.checks[name]:
            step.detail.append(f"{name}: {what}: {_first_diff(want, have)}")

    if render0 is not None:
        check("render0", render0, sent, "prompt sent != the chat template's render")
    if prev is not None:
        before = prev.input_ids() + prev.output_ids()
        check("prefix", before, sent[: len(before)], "previous prompt + sampled ids are not a prefix of this prompt")
    check("prompt", list(stored[:start]), sent, "stored prompt != prompt sent")
    check("sampled", got, list(stored[start:end]), "engine's sampled ids != stored sampled ids")
    want, have = _message_view(returned), _message_view(parsed)
    step.checks["parse"] = want == have
    if want != have:
        step.detail.append(f"parse: returned message {json.dumps(want, ensure_ascii=False)[:300]} != parse of "
                           f"stored ids {json.dumps(have, ensure_ascii=False)[:300]}")


def _parsed_dict(parsed: Any) -> dict[str, Any]:
    return {"content": parsed.content, "reasoning_content": parsed.reasoning_content,
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in parsed.tool_calls]}


async def _play(http: Any, proxy: RecordingProxy, codec: Any, tokenizer: Any, name: str,
                messages: list[dict[str, Any]], label: str, kw: dict[str, Any] | None,
                max_tokens: int, turns: int) -> list[EngineStep]:
    """One probe conversation, `turns` requests through the openai client."""
    from openai import AsyncOpenAI

    created = await http.post("/sessions", json={"chat_template_kwargs": kw} if kw else {})
    created.raise_for_status()
    sid = created.json()["session_id"]
    client = AsyncOpenAI(base_url=f"{str(http.base_url).rstrip('/')}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    steps: list[EngineStep] = []
    prev: Exchange | None = None
    msgs = list(messages)
    try:
        for n in range(turns):
            step = EngineStep(name, n, label)
            steps.append(step)
            mark = len(proxy.exchanges)
            try:
                resp = await client.chat.completions.create(
                    model="verify", messages=msgs, tools=TOOLS, max_tokens=max_tokens,  # type: ignore[arg-type]
                    temperature=0.7)
            except Exception as exc:
                step.error = f"the server did not complete the turn: {exc}"
                break
            mine = [e for e in proxy.exchanges[mark:] if e.status == 200]
            if not mine:
                step.error = "no generate request reached the engine"
                break
            ex = mine[-1]
            returned = resp.choices[0].message.model_dump(exclude_none=True)
            traj = (await http.get(f"/sessions/{sid}/trajectory")).json()
            branch = traj["branches"][-1]
            stored = [int(t) for t in branch["token_ids"]]
            turn = branch["turns"][-1]
            render0 = (encode(tokenizer, render_text(tokenizer, msgs, tools=TOOLS, add_generation_prompt=True,
                                                     template_kwargs=kw)) if n == 0 else None)
            sampled = stored[int(turn["output_start"]):int(turn["output_end"])]
            parsed = await asyncio.to_thread(codec.parse_assistant, sampled, tools=TOOLS, template_kwargs=kw)
            check_turn(step, ex, prev, stored, turn, render0=render0, returned=returned,
                       parsed=_parsed_dict(parsed))
            prev = ex
            msgs.append(returned)
            calls = returned.get("tool_calls") or []
            msgs += ([{"role": "tool", "tool_call_id": tc["id"], "content": "ok"} for tc in calls] if calls
                     else [{"role": "user", "content": "Thanks. And tomorrow?"}])
    finally:
        await client.close()
        await http.delete(f"/sessions/{sid}")
    return steps


async def _reachable(url: str) -> None:
    """Any HTTP answer will do: the server's start-up probes say the rest."""
    async with ClientSession(timeout=ClientTimeout(total=30)) as client, client.get(url.rstrip("/") + "/health"):
        pass


async def verify_engine(tokenizer: Any, engine: str, *, family: str | None = None, thinking: str = "both",
                        max_tokens: int = 256, turns: int = 2) -> EngineReport:
    """Serve `tokenizer` in front of `engine` ("URL", "sglang=URL" or "vllm=URL") through a
    recording proxy and play the probe conversations (module doc)."""
    import httpx

    from trajectory.codec import load_codec

    from ..app import AppConfig
    from ..settings import Settings
    from .harness import running_server

    protocol, sep, url = engine.partition("=")
    if not sep or protocol not in ("sglang", "vllm"):
        protocol, url = "", engine
    report = EngineReport(engine)
    proxy = RecordingProxy(url)
    _, plan = thinking_plan(tokenizer, thinking)
    try:
        codec = load_codec(tokenizer, family=family)
        await _reachable(url)
        async with proxy.running() as proxied:
            target = f"{protocol}={proxied}" if protocol else proxied
            config = AppConfig(tokenizer=tokenizer, engines=[target], settings=Settings(), family=family)
            async with running_server(config) as base, httpx.AsyncClient(base_url=base, timeout=600) as http:
                for label, kw in plan:
                    for name, messages in engine_scenarios():
                        report.steps += await _play(http, proxy, codec, tokenizer, name, messages, label, kw,
                                                    max_tokens, turns)
    except (Exception, SystemExit) as exc:  # cannot start: no codec, engine unreachable (uvicorn exits)
        report.error = f"{type(exc).__name__}: {exc}"
    return report
