"""The OpenAI Responses dialect, through the real `openai` SDK against the
server and the simulated engines (both protocols). The engine's request log is the
ground truth: whatever dialect a turn came in, the trajectory's prompt and sampled
ids and logprobs are exactly the engine's I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from openai import AsyncOpenAI
from openai.types.responses import Response

from session_server.api.dialects.openai_responses_output import ResponsesStreamEncoder
from session_server.api.dialects.openai_responses_request import (
    Echo,
    input_messages,
    parse_responses,
)
from session_server.errors import BadRequest, NotFound
from session_server.ops.demo import TOOLS, run_tool
from session_server.turn.stream_events import TurnFailed, TurnStarted

from ..e2e.test_openai_client_episodes import assert_trajectory_matches_engine
from ..stack import Stack, live_stack

PROTOCOLS = ["sglang", "vllm"]
# the demo's tools as Responses function tools (`openai/types/responses/function_tool.py`)
RTOOLS: list[dict[str, Any]] = [{"type": "function", **t["function"]} for t in TOOLS]
TASK = "The tests fail after the config change. Find out why and fix it."
INSTRUCTIONS = "You are a careful assistant. Use tools when they help."


def _client(st: Stack, sid: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{st.url}/sessions/{sid}/v1", api_key="x", max_retries=0)


def _plain(model: Any) -> Any:
    """A response or item as JSON data, without what the SDK's stream helper adds
    (`parsed_arguments`, `parsed`) or what is a wall-clock time."""
    data = orjson.loads(model.to_json())
    for item in data.get("output", [data]):
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    data.pop("completed_at", None)
    return data


def _tool_outputs(resp: Response) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": i.call_id, "output": run_tool(i.name, i.arguments)}
            for i in resp.output if i.type == "function_call"]


async def _episode(client: AsyncOpenAI, *, chain: bool, max_turns: int = 8) -> list[Response]:
    """A function-call loop: the full `input` replayed each turn (what Codex does), or
    only the new items with `previous_response_id` (`chain`)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    new: list[dict[str, Any]] = list(history)
    out: list[Response] = []
    for _ in range(max_turns):
        resp = await client.responses.create(
            model="m", instructions=INSTRUCTIONS, tools=RTOOLS,  # type: ignore[arg-type]
            input=new if chain else history,  # type: ignore[arg-type]
            previous_response_id=out[-1].id if chain and out else None, max_output_tokens=256,
        )
        out.append(resp)
        outputs = _tool_outputs(resp)
        if not outputs:
            break
        history += [i.model_dump(exclude_none=True) for i in resp.output] + outputs
        new = outputs
    return out


@pytest.mark.parametrize("chain", [False, True], ids=["full_input", "previous_response_id"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_function_call_loop_trajectory_equals_engine_io(qwen3_dir: Path, protocol: str, chain: bool) -> None:
    tag = f"{protocol}/{'chain' if chain else 'replay'}"
    async with live_stack(qwen3_dir, protocol) as st:
        sid = await st.session()
        client = _client(st, sid)
        episode = await _episode(client, chain=chain)
        stored = await client.responses.retrieve(episode[0].id)
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert len(episode) >= 2 and any(i.type == "function_call" for i in episode[0].output), tag
    last = episode[-1]
    assert last.status == "completed" and last.output_text, tag
    assert not [i for i in last.output if i.type == "function_call"], tag
    (branch,) = traj["branches"]  # every turn appended to one line, in both modes
    assert len(branch["turns"]) == len(episode), tag
    assert_trajectory_matches_engine(branch, log, tag)
    for resp, turn in zip(episode, branch["turns"], strict=True):
        assert resp.usage is not None
        assert resp.usage.output_tokens == turn["output_end"] - turn["output_start"], tag
        assert resp.usage.input_tokens == turn["output_start"], tag
        calls = [i for i in resp.output if i.type == "function_call"]
        assert [c.call_id for c in calls] == [tc["id"] for tc in turn["assistant_message"].get("tool_calls") or []]
        if resp.usage.output_tokens_details.reasoning_tokens:  # the sampled think block, through </think>
            assert any(i.type == "reasoning" for i in resp.output), tag
    assert stored.model_dump(exclude={"completed_at"}) == episode[0].model_dump(exclude={"completed_at"}), tag
    assert episode[1].previous_response_id == (episode[0].id if chain else None), tag


async def test_previous_response_id_of_an_earlier_response_attaches_at_its_checkpoint(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = _client(st, sid)
        first, second = (await _episode(client, chain=True, max_turns=2))[:2]
        # branch again from the first response, as if its tool had answered otherwise
        outputs = [{**o, "output": "error: no such file"} for o in _tool_outputs(first)]
        again = await client.responses.create(model="m", instructions=INSTRUCTIONS, tools=RTOOLS,  # type: ignore[arg-type]
                                              input=outputs, previous_response_id=first.id)  # type: ignore[arg-type]
        await client.close()
        traj = await st.trajectory(sid)
    assert second.id != again.id
    by_id = {b["id"]: b for b in traj["branches"]}
    assert len(by_id) == 2
    new = by_id[max(by_id)]
    assert new["parent_id"] == 0 and new["fork_checkpoint"] == 1  # after the first response's turn
    (turn,) = new["turns"]  # its own turn (the first is shared with the parent)
    assert turn["index"] == 1 and len(by_id[0]["turns"]) == 2
    assert turn["request_messages"][0]["content"] == "error: no such file"


async def test_streaming_accumulates_to_the_same_response(qwen3_dir: Path) -> None:
    """Reasoning (the qwen3 thinking template), function-call argument deltas, then text:
    the SDK's accumulated final response equals the stored one, deltas concatenate to
    the items, and `sequence_number` counts every event."""
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = _client(st, sid)
        prev: str | None = None
        new: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        finals: list[Response] = []
        all_events: list[list[Any]] = []
        for _ in range(8):
            async with client.responses.stream(model="m", instructions=INSTRUCTIONS, tools=RTOOLS,  # type: ignore[arg-type]
                                               input=new, previous_response_id=prev) as stream:  # type: ignore[arg-type]
                events = [ev async for ev in stream]
                final = await stream.get_final_response()
            finals.append(final)
            all_events.append(events)
            prev, new = final.id, _tool_outputs(final)
            if not new:
                break
        stored = [await client.responses.retrieve(f.id) for f in finals]
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert len(finals) >= 2
    kinds: set[str] = set()
    for events, final, kept in zip(all_events, finals, stored, strict=True):
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[1].type == "response.in_progress"
        assert events[-1].type == "response.completed"
        assert _plain(final) == _plain(kept)
        for idx, item in enumerate(final.output):
            kinds.add(item.type)
            mine = [e for e in events if getattr(e, "output_index", None) == idx]
            assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
            assert _plain(mine[-1].item) == _plain(item)
            deltas = "".join(e.delta for e in mine if e.type.endswith(".delta"))
            if item.type == "reasoning":
                assert item.content and deltas == item.content[0].text
            elif item.type == "message":
                assert deltas == final.output_text
            else:
                assert deltas == item.arguments
    assert kinds == {"reasoning", "message", "function_call"}
    (branch,) = traj["branches"]
    assert_trajectory_matches_engine(branch, log, "streamed")


async def test_max_output_tokens_is_incomplete(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir, "vllm") as st:
        sid = await st.session()
        client = _client(st, sid)
        resp = await client.responses.create(model="m", input=TASK, max_output_tokens=5)
        stream = await client.responses.create(model="m", input=TASK, max_output_tokens=5, stream=True)
        events = [ev async for ev in stream]
        await client.close()
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 5
    assert events[-1].type == "response.incomplete"  # as OpenAI ends a truncated stream
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


async def test_mixed_dialects_extend_one_trajectory(qwen3_dir: Path) -> None:
    """A chat-completions turn, then a Responses turn replaying it as items, then chat
    again: one line, every turn appended, exact engine I/O."""
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = _client(st, sid)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": TASK}]
        chat = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=256)  # type: ignore[arg-type]
        m = chat.choices[0].message
        assert m.tool_calls, "the scripted agent calls a tool first"
        items: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        reasoning = getattr(m, "reasoning_content", None)
        if reasoning:
            items.append({"type": "reasoning", "id": "rs_x", "summary": [],
                          "content": [{"type": "reasoning_text", "text": reasoning}]})
        if m.content:
            items.append({"role": "assistant", "content": m.content})
        # the calls, then their outputs: the order the turn produced them (interleaved, call
        # and output per call, would read as one turn per call: see docs/api.md)
        items += [{"type": "function_call", "call_id": tc.id, "name": tc.function.name,  # type: ignore[union-attr]
                   "arguments": tc.function.arguments} for tc in m.tool_calls]  # type: ignore[union-attr]
        items += [{"type": "function_call_output", "call_id": tc.id,
                   "output": run_tool(tc.function.name, tc.function.arguments)} for tc in m.tool_calls]  # type: ignore[union-attr]
        resp = await client.responses.create(model="m", instructions=INSTRUCTIONS, tools=RTOOLS,  # type: ignore[arg-type]
                                             input=items, max_output_tokens=256)  # type: ignore[arg-type]
        msgs.append(m.model_dump(exclude_none=True))
        msgs += [{"role": "tool", "tool_call_id": tc.id, "content": run_tool(tc.function.name, tc.function.arguments)}  # type: ignore[union-attr]
                 for tc in m.tool_calls]
        calls = [i for i in resp.output if i.type == "function_call"]
        rs = [i for i in resp.output if i.type == "reasoning"]
        msgs.append({"role": "assistant", "content": resp.output_text or None,
                     **({"reasoning_content": rs[0].content[0].text} if rs and rs[0].content else {}),
                     **({"tool_calls": [{"id": c.call_id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                        if calls else {})})
        msgs += [{"role": "tool", "tool_call_id": c.call_id, "content": run_tool(c.name, c.arguments)} for c in calls]
        if not calls:
            msgs.append({"role": "user", "content": "Thanks. Anything else?"})
        await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=256)  # type: ignore[arg-type]
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    (branch,) = traj["branches"]
    assert len(branch["turns"]) == 3
    assert_trajectory_matches_engine(branch, log, "mixed")


async def test_bad_input_is_400_and_unknown_previous_response_404(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid, other = await st.session(), await st.session()
        client = _client(st, sid)
        with pytest.raises(openai.BadRequestError, match="web_search"):  # forcing a tool it cannot call
            await client.responses.create(model="m", input=TASK, tools=[{"type": "web_search"}],
                                          tool_choice={"type": "web_search"})  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="input_image"):
            await client.responses.create(model="m", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://x/y.png"}]}])  # type: ignore[list-item]
        with pytest.raises(openai.BadRequestError, match="computer_call_output"):
            await client.responses.create(model="m", input=[{"type": "computer_call_output", "call_id": "c",
                                                             "output": {"type": "computer_screenshot"}}])  # type: ignore[list-item]
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            await client.responses.create(model="m", input=TASK, previous_response_id="resp_nope")
        theirs = await _client(st, other).responses.create(model="m", input=TASK, max_output_tokens=8)
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            await client.responses.create(model="m", input=TASK, previous_response_id=theirs.id)
        unstored = await client.responses.create(model="m", input=TASK, max_output_tokens=8, store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        r = await st.http.post(f"/sessions/{sid}/v1/responses", json={"input": TASK, "max_output_tokens": 0})
        await client.close()
    assert r.status_code == 400 and set(r.json()["error"]) == {"type", "message"}


async def test_reasoning_effort_switches_the_thinking_template(qwen3_dir: Path) -> None:
    async with live_stack(qwen3_dir) as st:
        sid = await st.session()
        client = _client(st, sid)
        await client.responses.create(model="m", input=TASK, max_output_tokens=8, reasoning={"effort": "none"})
        await client.close()
        log = await st.engine_log()
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(qwen3_dir)).decode(log[-1]["input_ids"])
    assert prompt.endswith("<think>\n\n</think>\n\n")  # enable_thinking=False, as the template renders it


def test_items_group_into_one_assistant_message() -> None:
    msgs = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "not sampled"}]},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
    ])
    assert msgs == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "x", "reasoning_content": "hm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
    ]
    with pytest.raises(BadRequest, match="role"):
        input_messages([{"role": "tool", "content": "x"}])
    with pytest.raises(NotFound):  # no session: a previous response names nothing
        parse_responses(orjson.dumps({"input": "hi", "previous_response_id": "resp_1"}))


def test_failed_stream_is_an_error_then_response_failed() -> None:
    enc = ResponsesStreamEncoder(Echo(created_at=0, model="m"), tokenizer=None)
    frames = enc.encode(TurnStarted("r1", 3)) + enc.encode(TurnFailed("upstream_invalid", "bad chunk", 502))
    events = [(f.split(b"\n")[0], orjson.loads(f.split(b"\n")[1].removeprefix(b"data: "))) for f in frames]
    assert [name for name, _ in events] == [b"event: response.created", b"event: response.in_progress",
                                           b"event: error", b"event: response.failed"]
    assert events[2][1]["code"] == "upstream_invalid" and events[2][1]["message"] == "bad chunk"
    assert events[3][1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for _, e in events] == [0, 1, 2, 3]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "streamed"])
async def test_openai_agents_responses_model_episode(qwen3_dir: Path, stream: bool) -> None:
    """openai-agents' `OpenAIResponsesModel` (its default model for OpenAI): the agent
    replays its own items each turn; every turn appends to one line."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def read_file(path: str) -> str:
        """Read a file."""
        calls.append(path)
        return "def test(): assert 1 == 2"

    @agents.function_tool
    def run_shell(command: str) -> str:
        """Run a shell command."""
        calls.append(command)
        return "1 failed"

    @agents.function_tool
    def search(query: str) -> str:
        """Search the code."""
        calls.append(query)
        return "tests/test_core.py:1"

    async with live_stack(qwen3_dir, "vllm") as st:
        sid = await st.session()
        client = _client(st, sid)
        agent = agents.Agent(
            name="fixer", instructions=INSTRUCTIONS, tools=[read_file, run_shell, search],
            model=agents.OpenAIResponsesModel(model="m", openai_client=client),
            model_settings=agents.ModelSettings(max_tokens=300),
        )
        if stream:
            run = agents.Runner.run_streamed(agent, TASK, max_turns=8)
            async for _ in run.stream_events():
                pass
            final = run.final_output
        else:
            final = (await agents.Runner.run(agent, TASK, max_turns=8)).final_output
        await client.close()
        traj = await st.trajectory(sid)
        log = await st.engine_log()
    assert isinstance(final, str) and final and calls
    (branch,) = traj["branches"]
    assert len(branch["turns"]) >= 2
    assert_trajectory_matches_engine(branch, log, f"openai-agents/{stream}")


@pytest.mark.parametrize("body", [
    {"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]},
    {"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": 3}},
    {"input": [{"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "tito-reasoning-v1:%%%"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]},
    {"input": "x", "reasoning": {"effort": "extreme"}},
])
def test_malformed_fields_are_400_not_500(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        parse_responses(orjson.dumps(body))
