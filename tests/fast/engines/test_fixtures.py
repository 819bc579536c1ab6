"""Contract tests: every captured engine response in the vendored fixtures (tests/fixtures/engines) goes through the
pure parsers and is either parsed to concrete values or rejected with a typed error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from session_server.engines import (
    parse_sglang_generate,
    parse_sglang_stream,
    parse_vllm_completions,
    parse_vllm_generate,
    parse_vllm_logprob_content,
)
from session_server.engines.base import GenerateResult
from session_server.errors import EngineError, UpstreamHTTPError, UpstreamInvalid

# Captured engine responses, vendored with their provenance (tests/fixtures/engines/SOURCES.md)
# so the contract tests always run: a missing directory fails, it never skips.
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "engines"
if not FIXTURES.is_dir():
    raise RuntimeError(f"captured engine fixtures not found at {FIXTURES}")

RID = "f" * 32


def sg(body: bytes, **kw: Any) -> GenerateResult:
    return parse_sglang_generate(body, request_id=RID, **kw)


def sg_lenient(body: bytes) -> GenerateResult:
    return parse_sglang_generate(body, request_id=RID, require_logprobs=False)


def vg(body: bytes) -> GenerateResult:
    return parse_vllm_generate(body, request_id=RID)


def vc(body: bytes) -> GenerateResult:
    return parse_vllm_completions(body, request_id=RID)


def _length_128_tail(r: GenerateResult) -> None:
    # 0.4.10-0.5.4: 133 output_ids, the first 5 are prompt tokens
    assert len(r.output_ids) == 128 and r.output_ids[0] == 12095
    assert r.finish_reason == "length" and r.completion_tokens == 128 and r.logprobs == []


def _expect_2026_length(r: GenerateResult) -> None:
    assert r.output_ids[:3] == [2014, 4226, 419] and len(r.output_ids) == 128
    assert (r.finish_reason, r.prompt_tokens, r.cached_tokens, r.weight_version) == (
        "length", 7, 0, "default")
    assert r.request_id == "c5d49e9d44854e80af4ade49f759fd7e"


def _expect_cached(r: GenerateResult) -> None:
    assert r.output_ids[:2] == [12095, 13] and len(r.output_ids) == 32
    assert (r.cached_tokens, r.prompt_tokens) == (2, 5)


def _expect_eos(r: GenerateResult) -> None:
    assert r.output_ids[-1] == 128009 and len(r.output_ids) == 15
    assert (r.finish_reason, r.matched_stop, r.cached_tokens) == ("stop", 128009, 49)


def _expect_jax(r: GenerateResult) -> None:
    assert r.output_ids == [279, 6722, 315, 279, 6722, 315, 9625, 382, 3872, 419]
    assert r.finish_reason == "length" and r.routed_experts is None


# name -> (parser, expected: callable check or error type). Every .json must be listed.
JSON_CASES: dict[str, tuple[Callable[[bytes], GenerateResult], Any]] = {
    # strict parser (the adapter always asks for logprobs): no triples -> invalid
    "sglang/generate_finish_length_2026-04.json": (sg_lenient, _expect_2026_length),
    "sglang/generate_finish_length32_cached_2026-04.json": (sg_lenient, _expect_cached),
    "sglang/generate_finish_stop_matched_eos_2026-04.json": (sg_lenient, _expect_eos),
    "sglang/generate_output_ids_prompt_tail_v0.5.4.post2.json": (sg_lenient, _length_128_tail),
    "sglang/generate_2025-08-11.json": (sg_lenient, _length_128_tail),
    # no output_ids and no logprobs: nothing to take ids from
    "sglang/generate_2025-05-22.json": (sg_lenient, UpstreamInvalid),
    "sglang/generate_2025-02-14.json": (sg_lenient, UpstreamInvalid),
    "sglang/generate_raw_wire_2024-11-02.json": (sg_lenient, UpstreamInvalid),
    "sglang/generate_raw_wire_stop_2024-11-02.json": (sg_lenient, UpstreamInvalid),
    "sglang/issue1608_log_out_v0.3.0.json": (sg_lenient, UpstreamInvalid),
    "sglang/issue442_frontend_meta_info_2024-05.json": (sg_lenient, UpstreamInvalid),
    "sglang/issue5734_log_out_0_v0.4.5.post3.json": (sg_lenient, UpstreamInvalid),
    "sglang/issue5734_log_out_1_v0.4.5.post3.json": (sg_lenient, UpstreamInvalid),
    "sglang/issue7641_generate_client_print_v0.4.7.json": (sg_lenient, UpstreamInvalid),
    # abort with status_code 503 is an engine error, not partial output
    "sglang/issue25887_abort_out_meta_info_v0.5.10.json": (sg, UpstreamHTTPError),
    # JSON lists: batch / n>1 / PD warm-up
    "sglang/generate_n3_returns_list_2026-04.json": (sg, UpstreamInvalid),
    "sglang/issue6753_pd_warmup_resp_0.json": (sg, UpstreamInvalid),
    "sglang/issue6753_pd_warmup_resp_1.json": (sg, UpstreamInvalid),
    "sglang/issue6854_pd_warmup_resp_0.json": (sg, UpstreamInvalid),
    "sglang/issue6854_pd_warmup_resp_1.json": (sg, UpstreamInvalid),
    "sglang/unattributed_code_comment_generate_logprob.json": (sg, UpstreamInvalid),
    # not /generate bodies at all
    "sglang/get_model_info_2026-04.json": (sg, UpstreamInvalid),
    "sglang/server_info_2026-04_trimmed.json": (sg, UpstreamInvalid),
    "sglang/update_weights_from_disk_ok_2026-04.json": (sg, UpstreamInvalid),
    "sglang/update_weights_from_disk_fail_2026-04.json": (sg, UpstreamInvalid),
    "sglang/openai_chat_completion_2026-04.json": (sg, UpstreamInvalid),
    "sglang/openai_completion_matched_stop_string_2026-04.json": (vc, UpstreamInvalid),
    "sglang-jax/run_in_pathways_generate_expected_output.json": (sg_lenient, _expect_jax),
    # vLLM: chat/completions bodies without token ids (not requested) -> invalid
    "vllm/art_chat_choice_token_id_strings_v0.8.5.post1.json": (vg, UpstreamInvalid),
    "vllm/chat_logprobs_v0.26.0_degenerate.json": (vg, UpstreamInvalid),
    "vllm/issue19052_chat_completion_v0.9.0.json": (vc, UpstreamInvalid),
    "vllm/llmd_modelservice_pd_completions_response.json": (vc, UpstreamInvalid),
    # synthetic: not engine generate bodies
    "synthetic/sglang_abort_frames_RUST_TEST_FIXTURE.json": (sg, UpstreamInvalid),
    "synthetic/vllm_pause_resume_is_paused_FROM_SOURCE.json": (vg, UpstreamInvalid),
}


def test_every_json_fixture_is_covered() -> None:
    found = {
        str(p.relative_to(FIXTURES))
        for sub in ("sglang", "sglang-jax", "vllm", "synthetic")
        for p in (FIXTURES / sub).glob("*.json")
    }
    assert found == set(JSON_CASES), found ^ set(JSON_CASES)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in JSON_CASES])
def test_json_fixture(name: str) -> None:
    parser, expected = JSON_CASES[name]
    body = (FIXTURES / name).read_bytes()
    if isinstance(expected, type) and issubclass(expected, EngineError):
        with pytest.raises(expected):
            parser(body)
    else:
        expected(parser(body))


def test_strict_parser_refuses_docs_samples_without_logprobs() -> None:
    body = (FIXTURES / "sglang/generate_finish_length_2026-04.json").read_bytes()
    with pytest.raises(UpstreamInvalid, match="output_token_logprobs"):
        sg(body)


def test_abort_status_code_maps_to_http_status() -> None:
    body = (FIXTURES / "sglang/issue25887_abort_out_meta_info_v0.5.10.json").read_bytes()
    with pytest.raises(UpstreamHTTPError) as info:
        sg(body)
    assert info.value.http_status == 503 and "timeout" in info.value.message


def test_uncoded_abort_frame_is_a_partial_abort() -> None:
    frames = json.loads((FIXTURES / "synthetic/sglang_abort_frames_RUST_TEST_FIXTURE.json").read_text())
    frame = dict(frames["uncoded_abort_frame"])
    frame["meta_info"] = {**frame["meta_info"], "output_token_logprobs": [], "completion_tokens": 0}
    r = sg(json.dumps(frame).encode())
    assert (r.finish_reason, r.abort_message, list(r.output_ids)) == ("abort", "cancelled", [])
    with pytest.raises(UpstreamHTTPError) as info:
        sg(json.dumps(frames["coded_abort_frame"]).encode())
    assert info.value.http_status == 503


def test_unattributed_logprob_sample_element() -> None:
    """The only real non-stream output_token_logprobs: [[-0.0140..., 5338, null]] with a
    5-prompt-token prefix in output_ids; parsed element-wise (the body itself is a list)."""
    elem = json.loads((FIXTURES / "sglang/unattributed_code_comment_generate_logprob.json").read_text())[0]
    r = sg(json.dumps(elem).encode())
    assert list(r.output_ids) == [5338] and r.logprobs == [-0.014046513475477695]
    assert list(r.output_ids_echo or []) == [5338]
    assert (r.finish_reason, r.prompt_tokens, r.cached_tokens) == ("length", 184, 158)


def test_pr17005_stream_fragments() -> None:
    """Truncated fragments are malformed JSON; the logprob triples that are complete parse."""
    text = (FIXTURES / "sglang/pr17005_generate_stream_logprobs_FRAGMENTS.txt").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("data: {")]
    assert lines
    for ln in lines:
        with pytest.raises(UpstreamInvalid):
            sg(ln[6:].encode())
    with pytest.raises(UpstreamInvalid):
        parse_sglang_stream(text, request_id=RID)
    # rebuild the first event's complete prefix: finish null mid-stream is refused as final
    first = lines[0]
    head = first[6 : first.index(',"input_top_logprobs"')] + "}}"
    event = json.loads(head)
    assert event["meta_info"]["output_token_logprobs"][2] == [-1.4560649394989014, 12095, None]
    with pytest.raises(UpstreamInvalid, match="finish_reason"):
        sg(head.encode())
    event["meta_info"]["finish_reason"] = {"type": "length", "length": 10}
    event["meta_info"]["completion_tokens"] = 10
    r = sg(json.dumps(event).encode())
    assert list(r.output_ids) == [16, 13, 12095, 220, 17, 13, 7148, 220, 18, 13]
    assert r.logprobs[8] == -0.00008332382276421413 and r.output_ids_echo == r.output_ids


def test_sglang_jax_truncated_is_invalid() -> None:
    text = (FIXTURES / "sglang-jax/pr13_generate_return_logprob_TRUNCATED.txt").read_text()
    body = next(ln for ln in text.splitlines() if ln.startswith('{"text"'))
    with pytest.raises(UpstreamInvalid):
        sg(body.encode())


def test_health_and_flush_texts_are_not_generate_bodies() -> None:
    for name in ("sglang/health_2026-04.txt", "sglang/health_generate_2026-04.txt",
                 "sglang/flush_cache_2026-04.txt"):
        with pytest.raises(UpstreamInvalid):
            sg((FIXTURES / name).read_bytes())


def test_vllm_token_id_string_logprobs() -> None:
    """ART (vLLM 0.8.5): token "token_id:N" strings, bytes [] for EOS, logprob 0.0."""
    choices = json.loads((FIXTURES / "vllm/art_chat_choice_token_id_strings_v0.8.5.post1.json").read_text())
    ids, lps, tops = parse_vllm_logprob_content(choices[1]["logprobs"]["content"])
    assert ids == [9454, 13, 151645] and lps == [-0.0793837234377861, 0.0, 0.0]
    assert tops == [[], [], []]
    # the same content inside a token-in generate body parses end to end
    body = {"request_id": RID, "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop",
                                            "logprobs": choices[1]["logprobs"]}]}
    r = vg(json.dumps(body).encode())
    assert list(r.output_ids) == [9454, 13, 151645] and r.output_ids_echo == ids
    assert (r.completion_tokens, r.prompt_tokens, r.cached_tokens) == (3, None, None)


def test_vllm_026_chat_logprob_entries() -> None:
    data = json.loads((FIXTURES / "vllm/chat_logprobs_v0.26.0_degenerate.json").read_text())
    content = data["choices"][0]["logprobs"]["content"]
    ids, lps, _ = parse_vllm_logprob_content(content)
    assert len(ids) == len(lps) == len(content) == data["usage"]["completion_tokens"]
    assert ids[0] == content[0]["token"]  # plain token text kept raw: validator rejects it


def test_vllm_gateway_stream_frames_are_not_final_bodies() -> None:
    text = (FIXTURES / "synthetic/vllm_inference_v1_generate_stream_GATEWAY_FIXTURE.txt").read_text()
    frames = [ln[6:] for ln in text.splitlines() if ln.startswith("data: {")]
    assert len(frames) == 4
    for f in frames:  # logprobs null / finish null / zero choices
        with pytest.raises(UpstreamInvalid):
            vg(f.encode())


@pytest.mark.parametrize("name", [
    "vllm/pr27561_completions_stream_first_chunk_prompt_token_ids.txt",
    "vllm/llamacpp_pr15189_vllm_completions_stream_echo_logprobs_PARTIAL.txt",
])
def test_vllm_completions_stream_chunks_are_invalid(name: str) -> None:
    text = (FIXTURES / name).read_text()
    frames = [ln.split("data: ", 1)[1] for ln in text.splitlines() if "data: {" in ln]
    assert frames
    for f in frames:
        with pytest.raises(UpstreamInvalid):
            vc(f.encode())


def test_vllm_finish_reason_mapping() -> None:
    def body(fr: Any) -> bytes:
        return json.dumps({"request_id": RID, "choices": [{
            "index": 0, "token_ids": [5], "finish_reason": fr, "stop_reason": None,
            "logprobs": {"content": [{"token_id": 5, "logprob": -0.1}]}}]}).encode()
    assert vg(body("repetition")).finish_reason == "repetition"
    assert vg(body("abort")).finish_reason == "abort"
    with pytest.raises(UpstreamHTTPError) as info:
        vg(body("error"))
    assert info.value.http_status == 500
    for bad in (None, "tool_calls"):
        with pytest.raises(UpstreamInvalid):
            vg(body(bad))


def test_sglang_bare_string_finish_and_raw_values() -> None:
    body = {"text": "", "output_ids": [1, 2, 3, 4, 5, True, 7],
            "meta_info": {"id": RID, "finish_reason": "length", "prompt_tokens": 3,
                          "completion_tokens": 2, "cached_tokens": 0, "new_key": {"x": 1},
                          "output_token_logprobs": [[None, True, None], [0.5, 7, "t"]],
                          "routed_experts": "QUJD"}}
    r = sg(json.dumps(body).encode())
    assert r.finish_reason == "length" and r.output_ids == [True, 7] and r.logprobs == [None, 0.5]
    assert r.output_ids_echo == [True, 7] and r.routed_experts == b'"QUJD"'
    for bad in (b"", b"{", b"[]", b'{"meta_info": {"finish_reason": {"type": "weird"}}}',
                b'{"meta_info": {"finish_reason": "stop", "output_token_logprobs": [1]}}',
                b'{"text": "x"}'):
        with pytest.raises(UpstreamInvalid):
            sg(bad)
