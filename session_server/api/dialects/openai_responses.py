"""The OpenAI Responses dialect: `POST .../v1/responses` -> `ChatRequest`, and
a committed turn -> a `response` object, or stream events -> Responses SSE events.

Field facts are the `openai` SDK's (2.54, `openai/types/responses/`): `Response`
(`response.py`), output items `ResponseReasoningItem` / `ResponseOutputMessage` /
`ResponseFunctionToolCall`, input items (`response_input_item_param.py`: `message`,
`function_call`, `function_call_output`, `reasoning`), `ResponseUsage` and the stream
events `Response*Event` (each carries `sequence_number`).

How items map onto the internal chat messages, so that every dialect writes the same
trajectory (a session may mix them):

- `instructions` -> a leading `system` message (not carried over by
  `previous_response_id`, as OpenAI documents on `Response.instructions`);
- `message` items -> messages of their role (text parts joined);
- consecutive `reasoning`, assistant `message` and `function_call` items -> ONE
  assistant message (`reasoning_content`, `content`, `tool_calls` with `id = call_id`):
  exactly the message the turn committed, so the history attaches where it was
  sampled (`trajectory.history.attach`);
- `function_call_output` -> a `tool` message (`tool_call_id = call_id`).

`previous_response_id` resolves against the session: a stored response is its branch
and turn in the trajectory tree, so the conversation up to it is that line's committed
messages (nothing copied per response), and the new request attaches at that turn's
checkpoint (a later response is rolled back from, not appended to).

This module is the dialect itself (what the routes call); the request side is
`openai_responses_request.py`, the response object and SSE events
`openai_responses_output.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from ...errors import NotFound, shown
from ...turn.chat_request import ChatRequest
from ...turn.pipeline import TurnOutput
from ...turn.stream_events import replay
from .openai_responses_output import (
    ResponsesStreamEncoder,
    StoredResponse,
    echo_of,
    final_object,
    outcome,
    response_id,
)
from .openai_responses_request import ResponsesRequest, parse_responses, template_switches


class OpenAIResponses:
    """`POST .../v1/responses`: OpenAI's Responses request in, a `response` object out."""

    name = "openai_responses"
    request_model = ResponsesRequest

    def parse(self, body: bytes, *, session: Any = None, switches: frozenset[str] = frozenset()) -> ChatRequest:
        """Without a session a `previous_response_id` is a 404 (it names nothing)."""
        return parse_responses(body, session=session, switches=switches)

    def parser(self, session: Any, tokenizer: Any) -> Callable[[bytes], ChatRequest]:
        """`parse` bound to a session (its stored responses) and the template's switches."""
        switches = template_switches(tokenizer)
        return lambda body: parse_responses(body, session=session, switches=switches)

    def body(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> bytes:
        echo = echo_of(req)
        return orjson.dumps(final_object(outcome(out, tokenizer, echo), echo))

    def encoder(self, req: ChatRequest, tokenizer: Any) -> ResponsesStreamEncoder:
        return ResponsesStreamEncoder(echo_of(req), tokenizer)

    def stream(self, out: TurnOutput, req: ChatRequest, tokenizer: Any) -> list[bytes]:
        enc = self.encoder(req, tokenizer)
        return [f for ev in replay(out) for f in enc.encode(ev)]

    def remember(self, session: Any, req: ChatRequest, out: TurnOutput, tokenizer: Any) -> tuple[str, Any] | None:
        """Keep a committed response (unless `store: false`) for `previous_response_id`
        and GET: its tree position and object parts, not its tokens."""
        echo = echo_of(req)
        if not echo.store:
            return None
        rid = response_id(out.request_id)
        kept = session.responses[rid] = StoredResponse(echo, outcome(out, tokenizer), out.branch_id, out.turn_index)
        return rid, kept

    def stored_body(self, session: Any, rid: str) -> bytes:
        stored: StoredResponse | None = session.responses.get(rid)
        if stored is None:
            raise NotFound(f"response {shown(rid)} is not stored in this session")
        return orjson.dumps(final_object(stored.outcome, stored.echo))


OPENAI_RESPONSES = OpenAIResponses()

__all__ = ["OPENAI_RESPONSES", "OpenAIResponses"]
