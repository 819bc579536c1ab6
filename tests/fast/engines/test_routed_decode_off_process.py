"""Routing replay (R3) responsiveness: a large reply's base64 routed experts are decoded in the
reply decoder's worker process (session_server/routed.py `predecode`), so the server
process only receives narrowed ids and never runs the GIL-holding base64 decode;
`join` checks decoded and raw payloads the same way (gap, shape, range)."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np
import orjson
import pytest

from session_server.engines.base import GenerateResult
from session_server.engines.reply_decoder import ReplyDecoder
from session_server.engines.sglang import parse_sglang_generate
from session_server.errors import UpstreamInvalid
from session_server.offload import CpuOffload
from session_server.routed import Decoded, Piece, RoutedShape, join, predecode, wire_size
from session_server.sim.routed import RoutedSpec, line_rows, sglang_payload, vllm_payload

SPEC = RoutedSpec(layers=6, topk=4, num_experts=40)
PROMPT, OUTPUT = list(range(100, 140)), list(range(200, 260))
LINE = PROMPT + OUTPUT
SHAPE = RoutedShape(layers=6, topk=4, num_experts=40)


def _body(routed: str) -> bytes:
    meta = {"id": "r1", "finish_reason": {"type": "length", "length": len(OUTPUT)}, "prompt_tokens": len(PROMPT),
            "completion_tokens": len(OUTPUT), "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in OUTPUT], "routed_experts": routed}
    return orjson.dumps({"text": "x", "output_ids": OUTPUT, "meta_info": meta})


async def test_a_large_reply_comes_back_with_its_routed_experts_decoded_and_narrowed() -> None:
    threads = CpuOffload(1)
    decoder = ReplyDecoder(threads, processes=1, large_reply_bytes=1024)
    try:
        await decoder.start()
        body = _body(sglang_payload(LINE, SPEC, 0))
        raw = parse_sglang_generate(body, request_id="r1").routed_experts
        assert isinstance(raw, bytes) and len(raw) > 1024
        calls: list[str] = []
        worker = decoder._worker()
        assert worker is not None
        real = worker.ask
        worker.ask = lambda *a, **k: (calls.append("process"), real(*a, **k))[1]  # type: ignore[method-assign]
        got = await decoder.run(parse_sglang_generate, body, request_id="r1", engine="e")
        assert calls == ["process"]
        routed = got.routed_experts
        assert isinstance(routed, Decoded), "the raw base64 crossed back into the server process"
        assert routed.ids.dtype == np.uint8 and routed.wire_bytes == len(raw) == wire_size(raw)
        np.testing.assert_array_equal(routed.ids, line_rows(LINE, SPEC).ravel())
        assert dataclasses.replace(got, routed_experts=raw) == parse_sglang_generate(body, request_id="r1")
        rows = join([Piece(routed, len(PROMPT), len(OUTPUT), 0)], start=0, end=len(LINE) - 1, shape=SHAPE)
        np.testing.assert_array_equal(rows, line_rows(LINE, SPEC))
    finally:
        await decoder.aclose()
        threads.shutdown()


class _Fold:
    """A stream fold's bound `result` (it runs on the threads) with a large payload."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def result(self) -> GenerateResult:
        return GenerateResult(request_id="r1", output_ids=OUTPUT, logprobs=[0.0] * len(OUTPUT), finish_reason="length",
                              matched_stop=None, prompt_tokens=len(PROMPT), completion_tokens=len(OUTPUT),
                              cached_tokens=0, routed_experts=self.raw)


async def test_a_streamed_results_large_payload_is_decoded_in_the_worker_too() -> None:
    threads = CpuOffload(1)
    decoder = ReplyDecoder(threads, processes=1, large_reply_bytes=1024)
    try:
        await decoder.start()
        raw = b'"' + sglang_payload(LINE, SPEC, 0).encode() + b'"'
        got = await decoder.run(_Fold(raw).result)
        assert isinstance(got.routed_experts, Decoded) and got.routed_experts.wire_bytes == len(raw)
        small = b'"' + sglang_payload(LINE[:3], SPEC, 0).encode() + b'"'
        assert (await decoder.run(_Fold(small).result)).routed_experts == small  # small: join decodes it
    finally:
        await decoder.aclose()
        threads.shutdown()


def _raw(rows: np.ndarray) -> bytes:
    return b'"' + base64.b64encode(rows.astype(np.int32).tobytes()) + b'"'


def _outcome(pieces: list[Piece], **kw: Any) -> Any:
    try:
        return join(pieces, **kw)
    except UpstreamInvalid as exc:
        return f"error: {exc}"


def _same(raws: list[bytes], starts: list[tuple[int, int, int]], **kw: Any) -> Any:
    """join over the raw payloads and over their `predecode`d forms: the same rows, or
    the same error."""
    plain = _outcome([Piece(r, *s) for r, s in zip(raws, starts, strict=True)], **kw)
    pre = _outcome([Piece(predecode(r), *s) for r, s in zip(raws, starts, strict=True)], **kw)
    if isinstance(plain, str):
        assert pre == plain
    else:
        assert pre.dtype == plain.dtype
        np.testing.assert_array_equal(pre, plain)
    return plain


def test_join_checks_decoded_payloads_as_it_checks_raw_ones() -> None:
    rows = line_rows(LINE, SPEC)
    end = len(LINE) - 1
    # two segments (abort -> resubmit) of the 99 positions: [0, 50) (a prompt of 41 + 10
    # sampled - 1), then [50, 99) (the 50 tokens so far + 50 sampled - 1)
    first, second = rows[:50], rows[50:]
    ok = _same([_raw(first), _raw(second)], [(41, 10, 0), (50, 50, 50)], start=0, end=end, shape=SHAPE)
    assert not isinstance(ok, str)
    np.testing.assert_array_equal(ok, rows)
    # a missing row, an extra row, a gap between segments, a shape the settings deny
    assert "rows for positions" in _same([_raw(rows[:-1])], [(len(PROMPT), len(OUTPUT), 0)], start=0, end=end,
                                         shape=SHAPE)
    assert "rows for positions" in _same([_raw(np.concatenate([rows, rows[-1:]]))], [(len(PROMPT), len(OUTPUT), 0)],
                                         start=0, end=end, shape=SHAPE)
    assert "start at 49" in _same([_raw(first), _raw(second)], [(41, 10, 0), (49, 51, 49)],
                                  start=0, end=end, shape=SHAPE)
    assert "not whole rows" in _same([_raw(rows[:, :5])], [(len(PROMPT), len(OUTPUT), 0)], start=0, end=end,
                                     shape=SHAPE)
    # ids out of range, either way: the message names them as the engine sent them
    for bad in (-1, 40, 70_000):
        bent = rows.astype(np.int32)
        bent.flat[-1] = bad
        assert "outside [0, 40)" in _same([_raw(bent)], [(len(PROMPT), len(OUTPUT), 0)], start=0, end=end,
                                          shape=SHAPE)
    # a payload that does not decode stays raw and fails in join with its usual message
    for broken in (b'"not base64!"', b'"AAA="', b'{"x": 1}'):
        assert predecode(broken) == broken
        assert _same([broken], [(len(PROMPT), len(OUTPUT), 0)], start=0, end=end, shape=SHAPE).startswith("error")
    assert predecode(None) is None and wire_size(None) is None


def test_vllm_routed_experts_decode_from_npy_and_from_nested_lists() -> None:
    end = len(LINE) - 1
    npy = b'"' + vllm_payload(LINE, SPEC).encode() + b'"'
    decoded = predecode(npy)
    assert isinstance(decoded, Decoded) and decoded.ids.shape == (end, 6, 4) and decoded.ids.dtype == np.uint8
    _same([npy], [(len(PROMPT), len(OUTPUT), 0)], start=0, end=end, shape=SHAPE)
    nested = orjson.dumps(line_rows(LINE, SPEC).tolist())
    assert predecode(nested) is nested  # the legacy list form (small) is decoded by join, as before
    _same([nested], [(len(PROMPT), len(OUTPUT), 0)], start=0, end=end, shape=SHAPE)


@pytest.mark.parametrize("experts", [200, 3000])
def test_predecode_narrows_to_the_smallest_dtype(experts: int) -> None:
    spec = RoutedSpec(layers=2, topk=2, num_experts=experts)
    decoded = predecode(b'"' + sglang_payload(LINE, spec, 0).encode() + b'"')
    assert isinstance(decoded, Decoded)
    assert decoded.ids.dtype == (np.uint8 if experts <= 256 else np.int16)
