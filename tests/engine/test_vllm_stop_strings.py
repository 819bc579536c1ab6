"""A client's stop string meets a pause on a real vLLM: the pause aborts the turn's request
inside the stop string, the resubmission completes it, and the server (which vLLM cannot
help here: it matches stop strings on a request's own output only, so it never sees one
begun in the kept partial) ends the turn exactly where the uninterrupted turn ends.

A random-weight model's text is noise, and greedy it repeats one token, so the engine is
scripted (`plugins/tito_script.py`): every request of the turn samples a fixed sentence
from where its prompt ends, as a deterministic model would, and vLLM's own stop-string
matching, abort, streaming and detokenizer do the rest. The engine is paced (250 ms a
token) so the pause, sent as the stream holds the stop string's first token, lands
inside it; a try where it did not is tried again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
import pytest

from .conftest import Stack
from .helpers import new_session, own_turns, trajectory, turn_exchanges, wait_until
from .recorder import Exchange

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

PACE_MS = 250.0  # the pause has 2-3 steps (0.5 s or more) to reach the engine inside the string
SENTENCE = ("The committee met on Tuesday to review the harbour plans, and after a long debate about "
            "the budget they agreed to build the new pier before the winter storms arrive next year, "
            "weather permitting.")
STOP = " before the winter storms"


def _tokens_of(tokenizer: Any, ids: list[int], text: str) -> tuple[int, int]:
    """(a, b): `text` first appears in the decoded `ids` after token a's start, and token
    b - 1 is the first whose decoded prefix holds all of it."""
    def upto(k: int) -> str:
        return str(tokenizer.decode(ids[:k], skip_special_tokens=False))

    b = next(k for k in range(len(ids) + 1) if text in upto(k))
    at = upto(len(ids)).index(text)
    a = max(k for k in range(b) if len(upto(k)) <= at)
    return a, b


def _sampled(ex: Exchange) -> int:
    try:
        return len(ex.reply()["choices"][0]["token_ids"])
    except (ValueError, KeyError, IndexError):
        return 0


async def _stream(http: httpx.AsyncClient, sid: str, body: dict[str, Any], out: list[str]) -> int:
    async with http.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=body) as resp:
        async for chunk in resp.aiter_text():
            out.append(chunk)
        return resp.status_code


async def test_a_stop_string_split_by_a_pause_ends_the_turn_where_the_uninterrupted_turn_ends(
        stack: Stack, qwen3_tokenizer: Any) -> None:
    script = list(qwen3_tokenizer.encode(SENTENCE, add_special_tokens=False))
    a, b = _tokens_of(qwen3_tokenizer, script, STOP)
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me the news."}],
            "max_tokens": len(script), "stop": [STOP], "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    misses: list[str] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=600) as http:
        # the uninterrupted turn: vLLM itself ends it on the stop string
        ref_sid = await new_session(http)
        with stack.rec.scripted(script):
            assert await _stream(http, ref_sid, body, []) == 200
        _, _, _, (ref,) = own_turns(await trajectory(http, ref_sid))
        for _ in range(4):
            sid = await new_session(http)
            sent = len(stack.rec.generations())
            shown: list[str] = []
            with stack.rec.scripted(script):
                with stack.rec.paced(PACE_MS):
                    chat = asyncio.create_task(_stream(http, sid, body, shown))

                    # sent once the string is begun: the engine, a step or two further on
                    # when the abort reaches it, is still short of the string's last token
                    async def begun(n: int = sent, c: asyncio.Task[int] = chat) -> bool:
                        return c.done() or any(_sampled(e) > a for e in stack.rec.generations()[n:])

                    await wait_until(begun, 60, "the stream to reach the stop string", every_s=0.01)
                    paused = await http.post("/control/pause", json={"mode": "abort"})
                assert paused.status_code == 200, paused.text
                await asyncio.sleep(0.3)
                assert (await http.post("/control/resume", json={})).status_code == 200
                assert await chat == 200
            line, _, lps, (turn,) = own_turns(await trajectory(http, sid))
            ours = {id(e) for e in stack.rec.generations()[sent:]}  # the reference's prompt is the same
            exchanges = [e for e in turn_exchanges(stack.rec, line, turn) if id(e) in ours]
            first = exchanges[0].reply()["choices"][0]
            k1 = len(first["token_ids"])
            if first.get("finish_reason") != "abort" or not a < k1 < b:
                misses.append(f"the pause cut the request at {k1} ({first.get('finish_reason')}), "
                              f"not inside the stop string's tokens {a}..{b - 1}")
                continue
            break
        else:
            raise AssertionError(f"no try paused inside the stop string: {misses}")
    ids = line[turn["output_start"]:turn["output_end"]].tolist()
    # the uninterrupted turn, which vLLM stopped on the string itself
    assert ref["finish_reason"] == "stop" and ref["output_end"] - ref["output_start"] == b, ref
    # the paused one ends on the same token, though the engine saw only the string's second half
    assert turn["finish_reason"] == "stop", (turn["finish_reason"], k1, a, b)
    assert ids == script[:b]
    assert len(exchanges) == 2 and turn["extra"]["control"]["resubmits"] == 1
    seg1, seg1_lps = exchanges[0].sampled()
    seg2, seg2_lps = exchanges[1].sampled()
    assert exchanges[1].request["token_ids"] == line[: turn["output_start"]].tolist() + seg1
    assert seg2[: b - k1] == script[k1:b]
    np.testing.assert_array_equal(lps[turn["output_start"]:turn["output_end"]],  # the engine's own logprobs
                                  np.asarray((seg1_lps + seg2_lps)[:b], dtype=np.float32).astype(np.float64))
    # the client saw what the uninterrupted turn shows: the decoded ids, through the string
    # (the message is the kept ids' text; the engines' own APIs trim it from theirs)
    content = str(qwen3_tokenizer.decode(script[:b], skip_special_tokens=False))
    assert content.endswith(STOP)
    assert turn["assistant_message"]["content"] == ref["assistant_message"]["content"] == content
    frames = [json.loads(x[6:]) for x in "".join(shown).splitlines()
              if x.startswith("data: ") and x != "data: [DONE]"]
    choices = [c for f in frames for c in f.get("choices") or []]
    assert "".join(c["delta"].get("content") or "" for c in choices) == content
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["stop"]
