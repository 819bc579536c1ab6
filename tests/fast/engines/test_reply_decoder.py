"""Large engine replies are decoded in a worker process, with errors intact."""

from __future__ import annotations

import pickle

import pytest

from session_server.engines.reply_decoder import ReplyDecoder
from session_server.engines.sglang import parse_sglang_generate
from session_server.errors import UpstreamHTTPError, UpstreamInvalid, UpstreamTransportError
from session_server.offload import CpuOffload


def test_engine_errors_survive_pickling_with_their_attributes() -> None:
    for err in (UpstreamHTTPError("boom", engine="http://e", http_status=503),
                UpstreamTransportError("reset", engine="http://e", transient=False),
                UpstreamInvalid("bad", engine="http://e")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.__dict__ == err.__dict__ and str(back) == str(err)


def _body(padding: bytes) -> bytes:
    return (b'{"text":"x","output_ids":[5,6],"meta_info":{"id":"r1","finish_reason":{"type":"stop","matched":6},'
            b'"prompt_tokens":3,"completion_tokens":2,"cached_tokens":1,'
            b'"output_token_logprobs":[[-0.5,5,null],[-0.25,6,null]],"routed_experts":' + padding + b"}}")


async def test_large_reply_decoded_in_a_process_equals_inline_decode() -> None:
    threads = CpuOffload(1)
    decoder = ReplyDecoder(threads, processes=1, large_reply_bytes=1024)
    try:
        await decoder.start()
        padding = b"[" + b",".join([b"[0.1,0.2,0.3]"] * 8000) + b"]"
        big = _body(padding)
        calls: list[str] = []
        worker = decoder._worker()
        assert worker is not None
        real = worker.ask
        worker.ask = lambda *a, **k: (calls.append("process"), real(*a, **k))[1]  # type: ignore[method-assign]
        got = await decoder.run(parse_sglang_generate, big, request_id="r1", engine="e")
        assert got == parse_sglang_generate(big, request_id="r1", engine="e")
        assert got.routed_experts == padding
        assert calls == ["process"]
        with pytest.raises(UpstreamInvalid) as info:
            await decoder.run(parse_sglang_generate, big[:-1] + b"    ", request_id="r1", engine="e")
        assert info.value.engine == "e"
        small = _body(b"null")
        assert (await decoder.run(parse_sglang_generate, small, request_id="r1")).routed_experts is None
        assert calls == ["process", "process"], "the small reply stayed out of the process"
    finally:
        await decoder.aclose()
        threads.shutdown()
