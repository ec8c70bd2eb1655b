"""The Responses formatter: numbered events, item ids equal in the stream and the final
response, the official SDK's stream accumulator agreeing with the response object."""

from __future__ import annotations

from typing import Any

from openai._models import construct_type_unchecked
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from sluice.core.errors import ContextOverflow
from sluice.core.events import (
    Event,
    Finish,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from sluice.core.frames import Frame
from sluice.dialects.responses.format import ResponseFields, ResponsesFormatter
from sluice.dialects.responses.shared import folded
from sluice.server.sse import encode

EVENTS: list[Event] = [
    Start(0, 20),
    ReasoningDelta(0, "Think."),
    TextDelta(0, "Let me ", token_count=1),
    TextDelta(0, "check.", token_count=1),
    ToolCallStart(0, 0, "call_1", "get_weather"),
    ToolCallDelta(0, 0, '{"city": '),
    ToolCallDelta(0, 0, '"Paris"}'),
    ToolCallEnd(0, 0),
    Finish(0, "tool_calls", Usage(0, 20, 9, cached_tokens=5)),
]


def run(events: list[Event], **fields: Any) -> tuple[list[Frame], ResponsesFormatter]:
    fmt = ResponsesFormatter(ResponseFields(id="resp_x", model="smollm2", **fields))
    frames = fmt.start()
    for event in events:
        frames += fmt.frames(event)
    frames += fmt.end()
    return frames, fmt


def data(frames: list[Frame]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        assert isinstance(frame.data, dict) and frame.event == frame.data["type"]
        out.append(frame.data)
    return out


def test_sequence_numbers_count_every_event_from_zero() -> None:
    frames, _ = run(EVENTS)
    assert [d["sequence_number"] for d in data(frames)] == list(range(len(frames)))


def test_the_order_of_events() -> None:
    kinds = [d["type"] for d in data(run(EVENTS)[0])]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_ids_in_the_stream_are_the_final_responses() -> None:
    frames, fmt = run(EVENTS)
    final = data(frames)[-1]["response"]
    assert final == fmt.response()
    output = final["output"]
    done = [d["item"] for d in data(frames) if d["type"] == "response.output_item.done"]
    assert done == output  # whole items, the same ids
    ids = {d.get("item_id") for d in data(frames) if "item_id" in d}
    assert ids <= {item["id"] for item in output}
    call = output[2]
    assert call["call_id"] == "call_1" and call["arguments"] == '{"city": "Paris"}'
    args_done = next(
        d for d in data(frames) if d["type"] == "response.function_call_arguments.done"
    )
    assert args_done["arguments"] == call["arguments"]
    assert final["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 5},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 29,
    }
    deltas = [d for d in data(frames) if d["type"] == "response.output_text.delta"]
    assert all(d["logprobs"] == [] for d in deltas)


def test_the_sdk_accumulates_the_stream_into_the_final_response() -> None:
    frames, _ = run(EVENTS)
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    for frame in frames:
        event = construct_type_unchecked(type_=ResponseStreamEvent, value=frame.data)  # type: ignore[arg-type]
        state.handle_event(event)
    final = state._completed_response  # type: ignore[attr-defined]
    assert final is not None
    assert final.id == "resp_x" and final.output_text == "Let me check."
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]


def test_max_output_tokens_is_incomplete_and_a_failure_is_failed() -> None:
    frames, fmt = run([Start(0, 4), TextDelta(0, "a", token_count=1), Finish(0, "length")])
    last = data(frames)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    fmt = ResponsesFormatter(ResponseFields(id="resp_y", model="m"))
    frames = fmt.start() + fmt.frames(Start(0, 4)) + fmt.frames(TextDelta(0, "a", token_count=1))
    frames += fmt.error(ContextOverflow(prompt_tokens=300, n_ctx=256))
    failed = data(frames)[-3:]
    # The open message is closed first; then one terminal event.
    assert [d["type"] for d in failed] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    assert failed[-1]["response"]["error"]["code"] == "context_length_exceeded"
    assert fmt.end() == []  # nothing after the terminal event


def test_background_starts_queued() -> None:
    frames, _ = run([], background=True)
    kinds = [d["type"] for d in data(frames)]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert data(frames)[0]["response"]["status"] == "queued"


def test_a_cancelled_response_says_so() -> None:
    fmt = ResponsesFormatter(ResponseFields(id="resp_z", model="m", background=True))
    fmt.start()
    fmt.frames(TextDelta(0, "partial", token_count=1))
    fmt.cancel()
    body = fmt.response()
    assert body["status"] == "cancelled" and body["output"][0]["content"][0]["text"] == "partial"
    assert fmt.end() == []


def test_the_events_so_far_fold_into_the_response_as_it_stands() -> None:
    """``shared.folded`` (GET through another instance): after each event the formatter
    makes, its frames so far fold into what the formatter itself answers then."""
    fmt = ResponsesFormatter(ResponseFields(id="resp_x", model="smollm2", background=True))
    frames = list(fmt.start())
    stored = fmt.response() | {"status": "queued"}
    for event in EVENTS:
        frames += fmt.frames(event)
        got = folded(stored, [encode(f) for f in frames])
        want = fmt.response()
        assert got["status"] == want["status"] == "in_progress"
        assert got["output"] == want["output"], event
    assert any(item["type"] == "function_call" for item in got["output"])
    assert folded(stored, []) == stored | {"output": []}
