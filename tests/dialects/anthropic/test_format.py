"""Anthropic's Messages formatter: synthetic event streams -> the named events, checked
for block bookkeeping, against the official SDK's own accumulator (the message it
builds from the frames == the non-streaming body), stop reasons and usage."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic._models import construct_type_unchecked
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from sluice.core.errors import ContextOverflow, EngineFailure, InvalidRequest, ServerBusy
from sluice.core.events import (
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from sluice.core.frames import Frame
from sluice.dialects.anthropic.format import (
    MessagesFormatter,
    error_body,
    tool_use_id,
)


def run(events: list[Event], max_tokens: int = 64) -> tuple[list[Frame], MessagesFormatter]:
    fmt = MessagesFormatter(model="smollm2", max_tokens=max_tokens)
    frames: list[Frame] = []
    for event in events:
        frames += fmt.frames(event)
    frames += fmt.end()
    return frames, fmt


def payloads(frames: list[Frame]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        assert isinstance(frame.data, dict)
        assert frame.event == frame.data["type"]  # the event name repeats the type
        out.append(frame.data)
    return out


def check_bookkeeping(data: list[dict[str, Any]]) -> None:
    """Every block started before its deltas, stopped before the next, numbered in order."""
    assert data[0]["type"] == "message_start"
    assert [d["type"] for d in data[-2:]] == ["message_delta", "message_stop"]
    open_block: int | None = None
    next_index = 0
    for d in data[1:-2]:
        if d["type"] == "content_block_start":
            assert open_block is None, "a block started before the last one stopped"
            assert d["index"] == next_index
            open_block, next_index = d["index"], next_index + 1
        elif d["type"] == "content_block_delta":
            assert d["index"] == open_block, "a delta for a block that is not open"
        elif d["type"] == "content_block_stop":
            assert d["index"] == open_block
            open_block = None
        else:
            raise AssertionError(f"unexpected {d['type']} between the blocks")
    assert open_block is None


def sdk_message(frames: list[Frame]) -> dict[str, Any]:
    """What the anthropic SDK's stream accumulator makes of the frames."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for frame in frames:
        event = construct_type_unchecked(type_=RawMessageStreamEvent, value=frame.data)  # type: ignore[arg-type]
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    built = snapshot.to_dict()
    # Fields of newer API versions the SDK fills in as null (stop_details, ...).
    return {k: v for k, v in built.items() if v is not None or k in ("stop_sequence",)}


def usage(prompt: int, completion: int, cached: int = 0) -> Usage:
    return Usage(0, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


MIXED: list[Event] = [
    Start(0, prompt_tokens=30),
    Progress(0, "prompt_processing", done=20, total=30, cached=20),  # the admission
    Progress(0, "prompt_processing", done=30, total=30, cached=20),
    ReasoningDelta(0, "Let me "),
    ReasoningDelta(0, "think."),
    TextDelta(0, "Checking", token_count=1),
    TextDelta(0, "", token_count=1),  # a token that decided no text yet
    TextDelta(0, " now.", token_count=1),
    ToolCallStart(0, 0, "call_abc", "get_weather"),
    ToolCallDelta(0, 0, '{"city": '),
    ToolCallDelta(0, 0, '"Paris"}'),
    ToolCallEnd(0, 0),
    ToolCallStart(0, 1, "call_def", "get_time"),
    ToolCallDelta(0, 1, "{}"),
    ToolCallEnd(0, 1),
    Finish(0, "tool_calls", usage(30, 12, cached=20)),
]


def test_blocks_are_started_streamed_and_stopped_in_order() -> None:
    frames, _ = run(MIXED)
    data = payloads(frames)
    check_bookkeeping(data)
    starts = [d["content_block"] for d in data if d["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "toolu_def", "name": "get_time", "input": {}},
    ]
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    kinds = [d["type"] for d in deltas]
    # The thinking block's signature comes last, just before it stops.
    assert kinds == [
        "thinking_delta",
        "thinking_delta",
        "signature_delta",
        "text_delta",
        "text_delta",
        "input_json_delta",
        "input_json_delta",
        "input_json_delta",
    ]
    assert deltas[2]["signature"]
    # No empty text delta goes out.
    assert all(d.get("text") != "" for d in deltas)
    assert "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta") == (
        '{"city": "Paris"}{}'
    )


def test_the_sdk_accumulates_the_stream_into_the_body() -> None:
    frames, fmt = run(MIXED)
    body = fmt.message()
    assert sdk_message(frames) == body
    assert body["content"][2]["input"] == {"city": "Paris"}
    assert body["content"][3]["input"] == {}
    assert body["stop_reason"] == "tool_use"
    assert body["id"].startswith("msg_")


def test_usage_splits_cache_reads_from_fresh_input() -> None:
    frames, fmt = run(MIXED)
    data = payloads(frames)
    # message_start waited for the admission, which knows the cache's share.
    assert data[0]["message"]["usage"] == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 20,
        "output_tokens": 0,
    }
    final = data[-2]["usage"]
    assert final == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 20,
        "output_tokens": 12,
    }
    assert fmt.message()["usage"] == final


@pytest.mark.parametrize(
    ("finish", "max_tokens", "reason", "sequence"),
    [
        (Finish(0, "stop", usage(5, 3)), 64, "end_turn", None),
        (Finish(0, "stop", usage(5, 3), stop_string="###"), 64, "stop_sequence", "###"),
        (Finish(0, "length", usage(5, 64)), 64, "max_tokens", None),
        # The context ended before max_tokens did.
        (Finish(0, "length", usage(5, 40)), 64, "model_context_window_exceeded", None),
        (Finish(0, "tool_calls", usage(5, 3)), 64, "tool_use", None),
    ],
)
def test_stop_reasons(finish: Finish, max_tokens: int, reason: str, sequence: str | None) -> None:
    frames, fmt = run([Start(0, 5), TextDelta(0, "Hi", token_count=1), finish], max_tokens)
    delta = payloads(frames)[-2]["delta"]
    assert delta == {"stop_reason": reason, "stop_sequence": sequence}
    assert (fmt.message()["stop_reason"], fmt.message()["stop_sequence"]) == (reason, sequence)


def test_without_usage_the_deltas_are_counted() -> None:
    events: list[Event] = [
        Start(0, 0),
        TextDelta(0, "a", token_count=1),
        TextDelta(0, "b", token_count=1),
        Finish(0, "length"),
    ]
    frames, fmt = run(events, max_tokens=2)
    assert payloads(frames)[-2]["usage"]["output_tokens"] == 2
    assert fmt.message()["stop_reason"] == "max_tokens"


def test_an_empty_answer_has_no_blocks() -> None:
    frames, fmt = run([Start(0, 4), Finish(0, "stop", usage(4, 1))])
    assert [d["type"] for d in payloads(frames)] == [
        "message_start",
        "message_delta",
        "message_stop",
    ]
    assert fmt.message()["content"] == []


def test_a_tool_call_started_while_another_is_open_closes_it_first() -> None:
    # An upstream's decoder ends every call only at the finish.
    events: list[Event] = [
        Start(0, 4),
        ToolCallStart(0, 0, "call_1", "a"),
        ToolCallDelta(0, 0, "{}"),
        ToolCallStart(0, 1, "call_2", "b"),
        ToolCallDelta(0, 1, '{"x": 1}'),
        ToolCallEnd(0, 0),
        ToolCallEnd(0, 1),
        Finish(0, "tool_calls", usage(4, 6)),
    ]
    frames, fmt = run(events)
    check_bookkeeping(payloads(frames))
    assert [b["input"] for b in fmt.message()["content"]] == [{}, {"x": 1}]
    assert sdk_message(frames) == fmt.message()


def test_arguments_that_are_not_json_are_kept() -> None:
    events: list[Event] = [
        Start(0, 4),
        ToolCallStart(0, 0, "call_1", "a"),
        ToolCallDelta(0, 0, "{oops"),
        Finish(0, "tool_calls", usage(4, 2)),
    ]
    _, fmt = run(events)
    assert fmt.message()["content"][0]["input"] == {"_raw_arguments": "{oops"}


def test_other_choices_and_echo_are_not_the_message() -> None:
    events: list[Event] = [
        Start(0, 4),
        TextDelta(0, "prompt", echo=True),
        TextDelta(1, "other", token_count=1),
        TextDelta(0, "mine", token_count=1),
        Finish(1, "stop"),
        Finish(0, "stop", usage(4, 1)),
    ]
    _, fmt = run(events)
    assert fmt.message()["content"] == [{"type": "text", "text": "mine"}]


def test_a_failure_in_the_stream_is_one_error_event() -> None:
    fmt = MessagesFormatter(model="m", max_tokens=8)
    fmt.frames(Start(0, 1))
    (frame,) = fmt.error(EngineFailure("decode failed"))
    assert frame.event == "error"
    assert frame.data == {
        "type": "error",
        "error": {"type": "api_error", "message": "decode failed"},
    }


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InvalidRequest("bad"), "invalid_request_error"),
        (ServerBusy("full"), "overloaded_error"),
        (EngineFailure("boom"), "api_error"),
    ],
)
def test_error_types_follow_the_status(error: Exception, kind: str) -> None:
    assert error_body(error)["error"]["type"] == kind  # type: ignore[arg-type]


def test_a_context_overflow_says_prompt_is_too_long() -> None:
    body = error_body(ContextOverflow(prompt_tokens=9000, n_ctx=8192))
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    # Claude Code matches these words to offer compacting the conversation.
    assert body["error"]["message"].startswith("prompt is too long: 9000 tokens > 8192 maximum")


def test_tool_use_ids() -> None:
    assert tool_use_id("call_abc") == "toolu_abc"
    assert tool_use_id("toolu_x") == "toolu_x"
    assert tool_use_id("xyz") == "toolu_xyz"


def test_frames_encode_as_named_events() -> None:
    from sluice.server.sse import encode

    frames, _ = run([Start(0, 1), TextDelta(0, "é", token_count=1), Finish(0, "stop")])
    raw = b"".join(encode(f) for f in frames)
    first = raw.split(b"\n\n")[0].split(b"\n")
    assert first[0] == b"event: message_start"
    assert json.loads(first[1].removeprefix(b"data: "))["type"] == "message_start"
    assert "é".encode() in raw


def test_without_an_admission_message_start_counts_the_whole_prompt() -> None:
    # An upstream's stream: no Progress, the split comes with the usage at the end.
    events: list[Event] = [
        Start(0, 0),
        TextDelta(0, "Hi", token_count=1),
        Finish(0, "stop", usage(9, 1, 4)),
    ]
    frames, _ = run(events)
    data = payloads(frames)
    assert [d["type"] for d in data[:2]] == ["message_start", "content_block_start"]
    assert data[0]["message"]["usage"]["input_tokens"] == 0
    assert (
        data[-2]["usage"]["input_tokens"] == 5 and data[-2]["usage"]["cache_read_input_tokens"] == 4
    )
