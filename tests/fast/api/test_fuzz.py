"""Fuzz the HTTP edge: schemathesis over our own
/openapi.json, every operation, positive and negative data; plus hypothesis chat
message shapes and raw bodies.

Pass condition, per request: no 5xx (the simulated engine is healthy, so no 5xx
is a real engine fault), no hang (every request has a client timeout), every
error in our envelope, and the seeded session's trajectory byte-identical after
each rejected request. Example counts are bounded (`TITO_FUZZ_EXAMPLES`, default
25 per operation and mode) so CI stays within a minute or two.

`python -m tests.fast.api.test_fuzz [examples]` runs the same and prints the
request count and status histogram (bench/README.md "Fuzzing the edge").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from session_server.app import AppConfig, create_app
from session_server.sim.tokenizers import build_tokenizer

from ..stack import live_stack

EXAMPLES = int(os.environ.get("TITO_FUZZ_EXAMPLES", "25"))
TIMEOUT_S = 30.0  # a request that takes longer is a hang

# The schema as served (building it needs no running server); one test per operation.
SCHEMA: dict[str, Any] = create_app(AppConfig(tokenizer="fuzz")).openapi()
# the viewer's live route is an endless event stream (keep-alives every 15 s): a client
# that reads it whole waits for its 600 s end; its answers are tested in tests/fast/turn/test_watch.py
ENDLESS = {("GET", "/sessions/{sid}/live")}
OPERATIONS = [(m.upper(), p) for p, ops in SCHEMA["paths"].items() for m in ops if (m.upper(), p) not in ENDLESS]


@dataclass
class Live:
    """A server + simulated engine on a background loop, with one seeded session."""

    url: str
    seeded: str  # a session with committed turns; must never change on a rejected request
    http: requests.Session = field(default_factory=requests.Session)
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    snapshot: bytes = b""

    def trajectory(self) -> bytes:
        r = self.http.get(f"{self.url}/sessions/{self.seeded}/trajectory", timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        return r.content

    def check(self, status: int, body: bytes, what: str, *, adds_engine: bool = False) -> None:
        """The pass condition for one answered request. The one real engine fault a fuzzer
        can cause: `POST /engines` naming a well-formed URL where no engine answers (502)."""
        self.statuses[status] += 1
        if adds_engine and status == 502:
            assert json.loads(body)["error"]["type"].startswith("upstream"), body
        else:
            assert status < 500, f"{what} -> {status}: {body[:400]!r}"
        if status >= 400:
            err = json.loads(body)["error"]
            assert isinstance(err["type"], str) and isinstance(err["message"], str), body
            assert self.trajectory() == self.snapshot, f"{what} -> {status} changed the seeded trajectory"
        else:
            self.snapshot = self.trajectory()  # an accepted turn may commit: the new reference


@contextlib.contextmanager
def serve(tokenizer_dir: Path) -> Iterator[Live]:
    """Run `live_stack` on its own loop in a thread (schemathesis and hypothesis are sync)."""
    ready: dict[str, Any] = {}
    started, stop = threading.Event(), threading.Event()

    async def main() -> None:
        try:
            async with live_stack(tokenizer_dir) as st_:
                sid = await st_.session(max_context_tokens=4096, sampling={"max_tokens": 32})
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
                for follow_up in ("Now run it.", None):
                    r = await st_.chat(sid, {"messages": msgs, "max_tokens": 32})
                    assert r.status_code == 200, r.text
                    if follow_up:
                        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": follow_up}]
                ready.update(url=st_.url, sid=sid)
                started.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
        except BaseException as exc:
            ready["error"] = exc
            started.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="fuzz-server", daemon=True)
    thread.start()
    started.wait(120)
    if "error" in ready:
        raise ready["error"]
    live = Live(url=ready["url"], seeded=ready["sid"])
    live.snapshot = live.trajectory()
    try:
        yield live
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture(scope="module")
def live(tokenizer_dirs: dict[str, Path]) -> Iterator[Live]:
    with serve(tokenizer_dirs["qwen3"]) as lv:
        yield lv


_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # a failure is reported as found, unshrunk
    suppress_health_check=list(HealthCheck),
)


def _undo(lv: Live, method: str, path: str, status: int, body: bytes) -> None:
    """Keep the server fit for the next case: resume after a pause, drop added engines."""
    if path == "/control/pause" and status in (200, 207):
        lv.http.post(f"{lv.url}/control/resume", json={}, timeout=TIMEOUT_S)
    if method == "POST" and path == "/engines" and status == 201:
        lv.http.delete(f"{lv.url}/engines/{json.loads(body)['id']}", timeout=TIMEOUT_S)


def fuzz_operation(lv: Live, method: str, path: str, examples: int = EXAMPLES) -> None:
    """Positive and negative schemathesis cases against one operation."""
    schema = schemathesis.openapi.from_dict(SCHEMA)
    op = schema[path][method]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

        @settings(_SETTINGS, max_examples=examples)
        @given(case=op.as_strategy(generation_mode=mode), pin=st.booleans())
        def run(case: Any, pin: bool) -> None:
            if "sid" in (case.path_parameters or {}) and pin:
                # half the cases address a real session: the seeded one, or a throwaway
                # one for DELETE (deleting the seeded one would end the comparison)
                if method == "DELETE":
                    case.path_parameters["sid"] = lv.http.post(f"{lv.url}/sessions", json={}).json()["session_id"]
                else:
                    case.path_parameters["sid"] = lv.seeded
            if (case.path_parameters or {}).get("engine_id", "").startswith("e"):
                return  # never remove the one real engine
            resp = case.call(base_url=lv.url, session=lv.http, timeout=TIMEOUT_S)
            _undo(lv, method, path, resp.status_code, resp.content)
            lv.check(
                resp.status_code,
                resp.content,
                f"{method} {path} {mode.value}: {case.as_curl_command()}",  # noqa: B023 (called in-loop)
                adds_engine=(method, path) == ("POST", "/engines"),  # noqa: B023
            )
            if resp.status_code != 401:
                case.validate_response(resp, checks=[status_code_conformance, content_type_conformance])

        try:
            run()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # nothing to negate (no parameter, no body)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_schemathesis_operation_no_5xx_no_hang_trajectory_intact(live: Live, method: str, path: str) -> None:
    fuzz_operation(live, method, path)


# -- hypothesis: chat message shapes and raw bodies ------------------------------------

_JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | st.text(max_size=10) | _JSON_LEAF
_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "refusal", "weird"]) | _JSON_LEAF},
    optional={"text": st.text(max_size=40) | _JSON_LEAF, "image_url": _JSON},
)
_CONTENT = st.text(max_size=200) | st.lists(_PART, max_size=3) | _JSON
_ARGS = st.text(max_size=40).map(json.dumps)  # JSON-string arguments (non-JSON ones: see below)
_TOOL_CALL = st.fixed_dictionaries(
    {"id": st.text(max_size=8), "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.text(min_size=1, max_size=12), "arguments": _ARGS})},
) | _JSON
_MESSAGE = st.fixed_dictionaries(
    {"role": _ROLE},
    optional={"content": _CONTENT, "tool_calls": st.lists(_TOOL_CALL, max_size=2) | _JSON,
              "tool_call_id": st.text(max_size=8) | _JSON_LEAF, "name": st.text(max_size=8) | _JSON_LEAF,
              "reasoning_content": st.text(max_size=40) | _JSON_LEAF},
)
_NUMBER = st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False, allow_infinity=False)
_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, max_size=4) | _JSON},
    optional={k: _NUMBER | _JSON_LEAF for k in (
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "top_logprobs", "n", "timeout_s",
    )} | {"stop": _JSON, "logprobs": _JSON_LEAF, "stream": _JSON_LEAF, "tools": _JSON,
          "chat_template_kwargs": _JSON},
)


def _deep(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"


_RAW = st.one_of(
    st.binary(max_size=200),  # anything, invalid UTF-8 included
    st.builds(lambda head, junk: head + junk, st.just(b'{"messages": [{"role": "user", "content": "'), st.binary(max_size=20)),
    st.builds(lambda junk: b'{"messages": [{"role": "user", "content": "' + junk + b'"}]}',
              st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\\ud800"])),
    st.integers(min_value=1, max_value=5000).map(_deep),
)


def fuzz_chat_shapes(lv: Live, examples: int = EXAMPLES * 4) -> None:
    url = f"{lv.url}/sessions/{lv.seeded}/v1/chat/completions"

    @settings(_SETTINGS, max_examples=examples)
    @given(body=_CHAT)
    def shapes(body: dict[str, Any]) -> None:
        r = lv.http.post(url, json=body, timeout=TIMEOUT_S)
        lv.check(r.status_code, r.content, f"chat {json.dumps(body)[:300]}")

    @settings(_SETTINGS, max_examples=examples)
    @given(raw=_RAW)
    def raw_bodies(raw: bytes) -> None:
        r = lv.http.post(url, data=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
        lv.check(r.status_code, r.content, f"raw {raw[:120]!r}")

    shapes()
    raw_bodies()


def test_hypothesis_chat_shapes_no_5xx_no_hang_trajectory_intact(live: Live) -> None:
    fuzz_chat_shapes(live)


def test_hypothesis_tool_call_non_json_arguments_are_4xx(live: Live) -> None:
    url = f"{live.url}/sessions/{live.seeded}/v1/chat/completions"

    @settings(_SETTINGS, max_examples=EXAMPLES)
    @given(args=st.text(max_size=30).filter(lambda s: not _is_json(s)))
    def run(args: str) -> None:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        r = live.http.post(url, json={"messages": msgs}, timeout=TIMEOUT_S)
        live.check(r.status_code, r.content, f"tool call arguments {args!r}")

    run()


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def main(examples: int) -> None:
    """Run every fuzz stage once and print the request count and status histogram."""
    with tempfile.TemporaryDirectory() as tmp, serve(build_tokenizer("qwen3", Path(tmp) / "qwen3")) as lv:
        for method, path in OPERATIONS:
            fuzz_operation(lv, method, path, examples)
        fuzz_chat_shapes(lv, examples * 4)
        total = sum(lv.statuses.values())
        print(json.dumps({"requests": total, "statuses": dict(sorted(lv.statuses.items()))}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else EXAMPLES)
