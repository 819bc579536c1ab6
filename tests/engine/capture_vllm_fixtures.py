"""Capture real replies of a running vLLM server as test fixtures.

Re-runnable: point it at a vLLM started with `VLLM_SERVER_DEV_MODE=1` and
`--enable-scale-out` (so `/inference/v1/generate`, `/pause`, `/resume`,
`/update_weight_version`, ... exist) and it rewrites every file in `--out`.

    python tests/engine/capture_vllm_fixtures.py --url http://127.0.0.1:18001 \
        --out tests/fixtures/engines/vllm/real-0.32.0-cpu

Every JSON file holds the exact request body (`request`, serialized with
`json.dumps(request)` and sent as those bytes), the reply as received
(`response_text`, verbatim), the same reply decoded (`response`, or null when it
is not JSON) and `http_status`. Files of several exchanges keep the same fields
per exchange, with `t_sent_s`/`t_done_s` seconds from the start of that scenario.
Streamed replies are stored byte for byte (decoded as UTF-8) in a `.txt` file next
to a `.json` file with the request.

It pauses the engine (`/pause?mode=abort` and `mode=keep`): any other client's
requests in flight at that moment are aborted or frozen too. It always resumes the
engine and puts the weight version back to what `GET /weight_info` said at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:18001"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "fixtures/engines/vllm/real-0.32.0-cpu"
GENERATE = "/inference/v1/generate"
TOKENIZER_SIZE = 151669  # len(Qwen3 tokenizer); the model has 151936 embedding rows
PADDED_ATTEMPTS = 40
LONG_TEXT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(30))
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
CITY_SCHEMA_SHORT = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
METRIC_LINE = re.compile(
    r"^(# (HELP|TYPE) )?vllm:(num_requests_running|num_requests_waiting|"
    r"[a-z_]*prefix_cache[a-z_]*|cache_config_info)\b"
)


class Capture:
    def __init__(self, client: httpx.AsyncClient, url: str, out: Path, model: str) -> None:
        self.client, self.url, self.out, self.model = client, url, out, model
        self.t0 = time.monotonic()
        self.written: list[str] = []

    def clock(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def call(self, method: str, path: str, body: Any = None,
                   params: dict[str, str] | None = None) -> dict[str, Any]:
        """One exchange, recorded with the exact request and the verbatim reply."""
        sent = self.now()
        content = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        r = await self.client.request(method, path, content=content, params=params,
                                      headers=headers)
        text = r.content.decode("utf-8")
        try:
            parsed = json.loads(text) if text else None
        except json.JSONDecodeError:
            parsed = None
        return {
            "method": method,
            "path": path,
            "query": params,
            "request": body,
            "http_status": r.status_code,
            "content_type": r.headers.get("content-type"),
            "response": parsed,
            "response_text": text,
            "t_sent_s": sent,
            "t_done_s": self.now(),
        }

    async def stream(self, body: dict[str, Any]) -> dict[str, Any]:
        """A streamed generate: the raw SSE bytes exactly as received, with the time
        each network chunk arrived."""
        sent = self.now()
        raw = bytearray()
        arrivals: list[list[float]] = []
        async with self.client.stream("POST", GENERATE, content=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"}) as r:
            async for chunk in r.aiter_raw():
                raw.extend(chunk)
                arrivals.append([self.now(), len(chunk)])
            status, ctype = r.status_code, r.headers.get("content-type")
        return {
            "method": "POST",
            "path": GENERATE,
            "query": None,
            "request": body,
            "http_status": status,
            "content_type": ctype,
            "raw": raw.decode("utf-8"),
            "chunk_arrivals_s_bytes": arrivals,
            "t_sent_s": sent,
            "t_done_s": self.now(),
        }

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        meta = {
            "captured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "engine_url": self.url,
            "served_model": self.model,
            "script": "tests/engine/capture_vllm_fixtures.py",
        }
        (self.out / name).write_text(json.dumps({"_capture": meta, **data}, indent=2,
                                                ensure_ascii=False) + "\n")
        self.written.append(name)

    def write_text(self, name: str, text: str) -> None:
        (self.out / name).write_bytes(text.encode("utf-8"))
        self.written.append(name)

    def write_stream(self, stem: str, ex: dict[str, Any], **extra: Any) -> None:
        raw = ex.pop("raw")
        self.write_text(f"{stem}.txt", raw)
        self.write_json(f"{stem}.json", {**ex, "stream_file": f"{stem}.txt", **extra})

    def generate_body(self, rid: str, prompt: list[int], stream: bool = False,
                      **sampling: Any) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_tokens": 16,
            "logprobs": 1,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        sp.update(sampling)
        return {"request_id": rid, "model": self.model, "token_ids": prompt,
                "sampling_params": sp, "stream": stream}


def render_prompt(tokenizer_path: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # newer transformers return a BatchEncoding here
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def decode(tokenizer_path: str, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(tokenizer_path).decode(ids))


def ids_of(ex: dict[str, Any]) -> list[int]:
    return list(ex["response"]["choices"][0]["token_ids"])


async def later(delay: float, fn: Callable[[], Awaitable[Any]]) -> Any:
    await asyncio.sleep(delay)
    return await fn()


def prefix_counters(metrics: str) -> dict[str, float]:
    got: dict[str, float] = {}
    for line in metrics.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


async def capture_basics(c: Capture, prompt: list[int]) -> None:
    c.clock()
    c.write_json("version.json", await c.call("GET", "/version"))
    c.write_json("models.json", await c.call("GET", "/v1/models"))
    c.write_json("is_paused.json", await c.call("GET", "/is_paused"))

    c.clock()
    ex = await c.call("POST", GENERATE, c.generate_body("capture-length-0001", prompt))
    c.write_json("generate_length.json", ex)

    c.clock()
    ex = await c.stream(c.generate_body("capture-stream-0001", prompt, stream=True))
    c.write_stream("generate_stream", ex, note="the same request as generate_length.json "
                   "with stream true, no stream_options")
    c.clock()
    body = c.generate_body("capture-stream-usage-0001", prompt, stream=True)
    body["stream_options"] = {"include_usage": True}
    ex = await c.stream(body)
    c.write_stream("generate_stream_include_usage", ex,
                   note="as generate_stream.json plus stream_options.include_usage")

    c.clock()
    body = {
        "model": c.model,
        "prompt": prompt,
        "max_tokens": 8,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "request_id": "capture-cmpl-0001",
        "stream": False,
    }
    c.write_json("completions_token_prompt.json", await c.call("POST", "/v1/completions", body))


async def capture_stop(c: Capture, tok: str, prompt: list[int]) -> None:
    c.clock()
    probe = await c.call("POST", GENERATE, c.generate_body(
        "capture-greedy-probe-0001", prompt, max_tokens=8, temperature=0))
    ids = ids_of(probe)
    stop_id = ids[2]  # the 3rd greedy id; it stops at its first occurrence
    ex = await c.call("POST", GENERATE, c.generate_body(
        "capture-stop-id-0001", prompt, max_tokens=8, temperature=0, stop_token_ids=[stop_id]))
    got = ids_of(ex)
    c.write_json("generate_stop_string.json", {
        **ex,
        "greedy_probe": probe,
        "notes": {
            "stop_token_id": stop_id,
            "first_index_of_stop_id_in_greedy_probe": ids.index(stop_id),
            "stop_token_text": decode(tok, [stop_id]),
            "greedy_prefix_reproduced": got == ids[: len(got)],
            "stop_token_included_in_token_ids": bool(got) and got[-1] == stop_id,
        },
    })

    # the same with a seeded sample, so that tokens come before the stop id
    c.clock()
    seeded = {"max_tokens": 8, "temperature": 1, "seed": 20261126}
    probe = await c.call("POST", GENERATE, c.generate_body(
        "capture-seeded-probe-0001", prompt, **seeded))
    ids = ids_of(probe)
    index = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i]), 2)
    stop_id = ids[index]
    ex = await c.call("POST", GENERATE, c.generate_body(
        "capture-stop-id-seeded-0001", prompt, stop_token_ids=[stop_id], **seeded))
    got = ids_of(ex)
    c.write_json("generate_stop_token_seeded.json", {
        **ex,
        "seeded_probe": probe,
        "notes": {
            "stop_token_id": stop_id,
            "stop_token_index_in_seeded_probe": index,
            "stop_token_text": decode(tok, [stop_id]),
            "seeded_prefix_reproduced": got == ids[: len(got)],
            "stop_token_included_in_token_ids": bool(got) and got[-1] == stop_id,
        },
    })


async def capture_structured(c: Capture, tok: str, prompt: list[int]) -> None:
    variants = (
        ("generate_structured_json.json", "capture-json-0001", {"json": CITY_SCHEMA}),
        ("generate_structured_json_no_whitespace.json", "capture-json-nows-0001",
         {"json": CITY_SCHEMA_SHORT, "disable_any_whitespace": True}),
    )
    for name, rid, so in variants:
        c.clock()
        ex = await c.call("POST", GENERATE, c.generate_body(
            rid, prompt, max_tokens=64, temperature=1, structured_outputs=so))
        notes: dict[str, Any] = {"structured_outputs": so}
        if ex["http_status"] == 200:
            text = decode(tok, ids_of(ex))
            notes["decoded_text"] = text
            try:
                value = json.loads(text)
                notes["valid_json"] = True
                notes["has_string_city"] = (isinstance(value, dict)
                                            and isinstance(value.get("city"), str))
            except json.JSONDecodeError as exc:
                notes["valid_json"] = False
                notes["json_error"] = str(exc)
        c.write_json(name, {**ex, "notes": notes})


async def capture_cache_salt(c: Capture, prompt: list[int], long_prompt: list[int]) -> None:
    c.clock()
    runs = []
    for label, ids in (("hi", prompt), ("long", long_prompt)):
        for i, salt in enumerate(("a", "a", "b")):
            before = prefix_counters((await c.client.get("/metrics")).text)
            body = c.generate_body(f"capture-salt-{label}-{i}", ids, max_tokens=4)
            body["cache_salt"] = salt
            ex = await c.call("POST", GENERATE, body)
            after = prefix_counters((await c.client.get("/metrics")).text)
            ex["prompt_label"] = label
            ex["prompt_len"] = len(ids)
            ex["usage"] = ex["response"].get("usage") if isinstance(ex["response"], dict) else None
            ex["metrics_prefix_cache_delta"] = {k: after.get(k, 0.0) - before.get(k, 0.0)
                                                for k in sorted(after)}
            runs.append(ex)
    c.write_json("generate_cache_salt.json", {
        "runs": runs,
        "notes": "block_size is 128 (vllm:cache_config_info): the 9-token 'hi' prompt has no "
                 "full block to cache, so a long prompt runs too. metrics deltas include any "
                 "other client's requests sent in the same window.",
    })


async def capture_padded(c: Capture, prompt: list[int]) -> None:
    c.clock()
    for attempt in range(PADDED_ATTEMPTS):
        ex = await c.call("POST", GENERATE, c.generate_body(
            f"capture-padded-{attempt:03d}", prompt, max_tokens=400, temperature=1))
        ids = ids_of(ex)
        hits = [[i, t] for i, t in enumerate(ids) if t >= TOKENIZER_SIZE]
        if hits:
            c.write_json("generate_padded_vocab_id.json", {**ex, "notes": {
                "tokenizer_size": TOKENIZER_SIZE,
                "model_vocab_rows": 151936,
                "attempts": attempt + 1,
                "first_padded_index": hits[0][0],
                "padded_index_id_pairs": hits,
            }})
            return
    c.write_json("generate_padded_vocab_id.json", {"notes": {
        "found": False, "attempts": PADDED_ATTEMPTS}})


async def capture_abort_requests(c: Capture, prompt: list[int]) -> None:
    c.clock()
    exchanges = [
        await c.call("POST", "/inference/v1/abort_requests", {"request_ids": ["nope"]}),
        await c.call("POST", "/abort_requests", {"request_ids": ["nope"]}),
    ]
    c.write_json("abort_requests.json", {"exchanges": exchanges})

    # which id aborts a running generate: the one sent, or the echoed `generate-tokens-` one
    trials = []
    for n, (path, prefixed) in enumerate((("/abort_requests", False),
                                          ("/abort_requests", True),
                                          ("/inference/v1/abort_requests", False),
                                          ("/inference/v1/abort_requests", True))):
        c.clock()
        rid = f"capture-abort-id-{n}"
        target = f"generate-tokens-{rid}" if prefixed else rid
        body = c.generate_body(rid, prompt, max_tokens=200, temperature=1)
        del body["sampling_params"]["logprobs"]  # only the finish and the length matter here
        gen = asyncio.create_task(c.call("POST", GENERATE, body))
        abort = await later(1.0, lambda p=path, t=target: c.call(
            "POST", p, {"request_ids": [t]}))
        reply = await gen
        trials.append({"abort_path": path, "abort_id": target, "abort": abort,
                       "generate": reply,
                       "finish_reason": reply["response"]["choices"][0]["finish_reason"],
                       "n_tokens": len(ids_of(reply))})
    c.write_json("abort_by_request_id.json", {"trials": trials})


async def capture_pause_abort(c: Capture, prompt: list[int]) -> None:
    c.clock()
    bad = await c.call("POST", "/pause", params={"mode": "bogus"})
    after = await c.call("GET", "/is_paused")
    c.write_json("pause_bad_mode.json", {**bad, "is_paused_after": after})

    c.clock()
    gen = asyncio.create_task(c.call("POST", GENERATE, c.generate_body(
        "capture-abort-paused-0001", prompt, max_tokens=400, temperature=1)))
    pause = paused = resumed = None
    done: set[Any] = set()
    try:
        pause = await later(1.0, lambda: c.call("POST", "/pause", params={"mode": "abort"}))
        paused = await c.call("GET", "/is_paused")
        done, _ = await asyncio.wait({gen}, timeout=30)
    finally:
        resumed = await c.call("POST", "/resume")
    reply = await gen
    after = await c.call("GET", "/is_paused")
    c.write_json("generate_abort_paused.json", {
        **reply, "pause": pause, "is_paused_while_paused": paused,
        "reply_arrived_before_resume": bool(done), "resume": resumed,
        "is_paused_after_resume": after})


async def capture_keep_split(c: Capture, prompt: list[int], *, stream: bool) -> None:
    c.clock()
    set7 = await c.call("POST", "/update_weight_version", {"new_version": "7"})
    rid = "capture-keep-split-stream-0001" if stream else "capture-keep-split-0001"
    body = c.generate_body(rid, prompt, stream=stream, max_tokens=300, temperature=1)
    gen = asyncio.create_task(c.stream(body) if stream else c.call("POST", GENERATE, body))
    control: list[dict[str, Any]] = [set7]
    try:
        await asyncio.sleep(1.0)
        control.append(await c.call("POST", "/pause", params={"mode": "keep"}))
        control.append(await c.call("GET", "/is_paused"))
        control.append(await c.call("POST", "/update_weight_version", {"new_version": "8"}))
        control.append(await c.call("GET", "/weight_info"))
        await asyncio.sleep(0.5)  # nothing is generated while paused (see the stream arrivals)
    finally:
        control.append(await c.call("POST", "/resume"))
    reply = await gen
    if stream:
        c.write_stream("generate_keep_version_split_stream", reply, control=control)
    else:
        c.write_json("generate_keep_version_split.json", {**reply, "control": control})


async def capture_metrics(c: Capture, prompt: list[int]) -> None:
    gen = asyncio.create_task(c.call("POST", GENERATE, c.generate_body(
        "capture-metrics-0001", prompt, max_tokens=200, temperature=1)))
    await asyncio.sleep(0.5)
    text = (await c.client.get("/metrics")).text
    await gen
    lines = [ln for ln in text.splitlines() if METRIC_LINE.match(ln)]
    c.write_text("metrics_excerpt.txt", "\n".join(lines) + "\n")


async def run(url: str, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        model = str((await client.get("/v1/models")).json()["data"][0]["id"])
        c = Capture(client, url, out_dir, model)
        tok = model  # the served model name is its local directory, tokenizer included
        prompt = render_prompt(tok, "hi")
        long_prompt = render_prompt(tok, LONG_TEXT)
        c.clock()
        info = await c.call("GET", "/weight_info")
        c.write_json("weight_info.json", info)
        original = info["response"]["weight_version"]
        try:
            await capture_basics(c, prompt)
            await capture_stop(c, tok, prompt)
            await capture_structured(c, tok, prompt)
            await capture_cache_salt(c, prompt, long_prompt)
            await capture_padded(c, prompt)
            await capture_abort_requests(c, prompt)
            await capture_pause_abort(c, prompt)
            await capture_keep_split(c, prompt, stream=False)
            await capture_keep_split(c, prompt, stream=True)
            await capture_metrics(c, prompt)
        finally:
            await client.post("/resume")
            c.clock()
            restore = await c.call("POST", "/update_weight_version", {"new_version": original})
            missing = await c.call("POST", "/update_weight_version", {"version": original})
            c.write_json("update_weight_version.json", {
                **restore, "without_new_version": missing,
                "weight_info_after": await c.call("GET", "/weight_info"),
                "is_paused_after": await c.call("GET", "/is_paused")})
        return c.written


def main(url: str = DEFAULT_URL, out_dir: str | Path = DEFAULT_OUT) -> list[str]:
    written = asyncio.run(run(url.rstrip("/"), Path(out_dir)))
    for name in written:
        print(Path(out_dir) / name)
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    main(args.url, args.out)
