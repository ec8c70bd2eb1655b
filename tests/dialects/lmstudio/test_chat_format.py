"""LM Studio's /api/v1/chat formatter: synthetic event streams -> the exact named events
LM Studio sends, chat.end's result == the non-streaming body, and the stats' arithmetic."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sluice.core.errors import EngineFailure, InvalidRequest, ModelLoadFailed
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    Progress,
    ReasoningDelta,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResult,
    Usage,
)
from sluice.core.frames import Frame
from sluice.dialects.lmstudio.format import LMStudioChatFormatter
from sluice.server.sse import sse_stream

CALC = {"type": "plugin", "plugin_id": "mcp/calc"}
WEB = {"type": "ephemeral_mcp", "server_label": "web"}


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


Step = Event | float  # a float advances the clock by that many seconds


def formatter(clock: Clock, **kw: Any) -> LMStudioChatFormatter:
    return LMStudioChatFormatter("qwen3-0.6b", clock=clock, **kw)


def feed(fmt: LMStudioChatFormatter, clock: Clock, steps: list[Step]) -> list[Frame]:
    frames = fmt.start()
    for step in steps:
        if isinstance(step, float):
            clock.now += step
        else:
            frames += fmt.frames(step)
    return frames


def run(steps: list[Step], **kw: Any) -> tuple[list[Frame], LMStudioChatFormatter]:
    clock = Clock()
    fmt = formatter(clock, **kw)
    frames = feed(fmt, clock, steps)
    frames += fmt.end()
    check_end(frames, fmt)
    return frames, fmt


def check_end(frames: list[Frame], fmt: LMStudioChatFormatter) -> None:
    """Every frame is named by its type; the last is chat.end carrying result()."""
    for frame in frames:
        assert isinstance(frame.data, dict)
        assert frame.event == frame.data["type"]
    assert frames[0].data == {"type": "chat.start", "model_instance_id": "qwen3-0.6b"}
    assert frames[-1].event == "chat.end"
    assert isinstance(frames[-1].data, dict)
    assert frames[-1].data["result"] == fmt.result()
    assert fmt.end() == [] and fmt.error(EngineFailure("late")) == []  # once


def kinds(frames: list[Frame]) -> list[str]:
    return [str(f.event) for f in frames]


def datas(frames: list[Frame]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        assert isinstance(frame.data, dict)
        out.append(frame.data)
    return out


def pp(done: int, total: int, cached: int = 0) -> Progress:
    return Progress(0, "prompt_processing", done, total, cached)


def load(done: int, total: int, elapsed: float) -> Progress:
    return Progress(0, "model_load", done, total, elapsed=elapsed)


def finish(prompt: int, completion: int, reason: Any = "stop") -> Finish:
    return Finish(0, reason, Usage(0, prompt, completion))


PROMPT_DONE = ["prompt_processing.start", "prompt_processing.progress", "prompt_processing.end"]


# -- plain answers ------------------------------------------------------------------------


def test_a_plain_answer() -> None:
    frames, fmt = run(
        [
            Start(0, 5),
            0.1,
            pp(0, 5),
            0.2,
            pp(5, 5),
            0.2,
            TextDelta(0, "Hel", 1),
            0.1,
            TextDelta(0, "lo", 1),
            0.1,
            TextDelta(0, "!", 1),
            finish(5, 3),
        ],
        response_id="resp_abc",
    )
    assert datas(frames) == [
        {"type": "chat.start", "model_instance_id": "qwen3-0.6b"},
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
        {"type": "message.start"},
        {"type": "message.delta", "content": "Hel"},
        {"type": "message.delta", "content": "lo"},
        {"type": "message.delta", "content": "!"},
        {"type": "message.end"},
        {"type": "chat.end", "result": fmt.result()},
    ]
    result = fmt.result()
    assert list(result) == ["model_instance_id", "output", "stats", "response_id"]
    assert result == {
        "model_instance_id": "qwen3-0.6b",
        "output": [{"type": "message", "content": "Hello!"}],
        "stats": {
            "input_tokens": 5,
            "total_output_tokens": 3,
            "reasoning_output_tokens": 0,
            "tokens_per_second": 15.0,  # 3 tokens from t=0.5 to t=0.7
            "time_to_first_token_seconds": 0.4,  # from prompt processing's start
        },
        "response_id": "resp_abc",
    }


async def test_no_response_id_unless_stored_and_sse_bytes() -> None:
    async def events() -> AsyncIterator[Event]:
        for event in [Start(0, 2), TextDelta(0, "Hi", 1), finish(2, 1)]:
            yield event

    fmt = LMStudioChatFormatter("m")  # sse_stream alone: chat.start comes with the first event
    body = b"".join([chunk async for chunk in sse_stream(events(), fmt)]).decode()
    blocks = body.strip().split("\n\n")
    assert blocks[0] == 'event: chat.start\ndata: {"type":"chat.start","model_instance_id":"m"}'
    assert [b.split("\n")[0] for b in blocks] == [
        "event: chat.start",
        *[f"event: {k}" for k in PROMPT_DONE],
        "event: message.start",
        "event: message.delta",
        "event: message.end",
        "event: chat.end",
    ]
    end = json.loads(blocks[-1].split("\n", 1)[1].removeprefix("data: "))
    assert list(end["result"]) == ["model_instance_id", "output", "stats"]


def test_reasoning_then_answer_counts_reasoning_tokens() -> None:
    frames, fmt = run(
        [
            Start(0, 8),
            pp(0, 8),
            pp(8, 8),
            0.5,
            TextDelta(0, "", 1),  # <think>: no block yet, reasoning's once one opens
            ReasoningDelta(0, "Let me"),
            TextDelta(0, "", 1),
            0.5,
            ReasoningDelta(0, " think"),
            TextDelta(0, "", 1),
            TextDelta(0, "", 1),  # </think>: the reasoning block is still the open one
            0.5,
            TextDelta(0, "4", 1),
            finish(8, 5),
        ]
    )
    assert kinds(frames) == [
        "chat.start",
        *PROMPT_DONE,
        "reasoning.start",
        "reasoning.delta",
        "reasoning.delta",
        "reasoning.end",
        "message.start",
        "message.delta",
        "message.end",
        "chat.end",
    ]
    assert [f.data for f in frames if f.event == "reasoning.delta"] == [
        {"type": "reasoning.delta", "content": "Let me"},
        {"type": "reasoning.delta", "content": " think"},
    ]
    result = fmt.result()
    assert result["output"] == [
        {"type": "reasoning", "content": "Let me think"},
        {"type": "message", "content": "4"},
    ]
    stats = result["stats"]
    assert stats["reasoning_output_tokens"] == 4
    assert stats["total_output_tokens"] == 5
    assert stats["tokens_per_second"] == 5.0  # first token at +0.5, last at +1.5
    assert stats["time_to_first_token_seconds"] == 0.5


def test_switching_kinds_opens_each_block_once() -> None:
    frames, fmt = run(
        [
            Start(0, 1),
            ReasoningDelta(0, "a"),
            TextDelta(0, "b", 1),
            TextDelta(0, "", 0),  # empty, no tokens: nothing at all
            ReasoningDelta(0, ""),
            ReasoningDelta(0, "c"),
            TextDelta(0, "d", 1),
            TextDelta(0, "echo", 0, echo=True),
        ]
    )
    assert kinds(frames)[4:] == [
        "reasoning.start",
        "reasoning.delta",
        "reasoning.end",
        "message.start",
        "message.delta",
        "message.end",
        "reasoning.start",
        "reasoning.delta",
        "reasoning.end",
        "message.start",
        "message.delta",
        "message.end",
        "chat.end",
    ]
    assert [item["content"] for item in fmt.result()["output"]] == ["a", "b", "c", "d"]
    # No usage on the Finish (none came): the deltas' counts stand.
    assert fmt.result()["stats"]["total_output_tokens"] == 2


# -- model load and prompt processing -------------------------------------------------


def test_model_load_progress_is_strictly_increasing_and_ends_at_one() -> None:
    frames, fmt = run(
        [
            load(0, 100, 0.0),
            0.5,
            load(30, 100, 0.5),
            load(20, 100, 0.6),  # jitter: dropped
            load(30, 100, 0.7),  # a repeat: dropped
            load(65, 100, 1.2),
            0.8,
            load(100, 100, 2.5),
            load(100, 100, 2.5),  # after the end: nothing
            Start(0, 3),
            pp(0, 3),
            pp(3, 3),
            0.25,
            TextDelta(0, "ok", 1),
            finish(3, 1),
        ]
    )
    mid = "qwen3-0.6b"
    assert datas(frames)[1:6] == [
        {"type": "model_load.start", "model_instance_id": mid},
        {"type": "model_load.progress", "model_instance_id": mid, "progress": 0.3},
        {"type": "model_load.progress", "model_instance_id": mid, "progress": 0.65},
        {"type": "model_load.progress", "model_instance_id": mid, "progress": 1.0},
        {"type": "model_load.end", "model_instance_id": mid, "load_time_seconds": 2.5},
    ]
    assert kinds(frames)[6:9] == PROMPT_DONE
    stats = fmt.result()["stats"]
    assert list(stats)[-1] == "model_load_time_seconds"
    assert stats["model_load_time_seconds"] == 2.5
    # From prompt processing's start (after the load), not from the request's.
    assert stats["time_to_first_token_seconds"] == 0.25


def test_a_load_that_ends_unannounced_is_ended_with_progress_one() -> None:
    frames, fmt = run([load(50, 100, 1.0), 0.5, Start(0, 2), TextDelta(0, "x", 1), finish(2, 1)])
    assert kinds(frames)[1:5] == [
        "model_load.start",
        "model_load.progress",
        "model_load.progress",
        "model_load.end",
    ]
    assert [f.data["progress"] for f in frames[2:4] if isinstance(f.data, dict)] == [0.5, 1.0]
    assert frames[4].data == {
        "type": "model_load.end",
        "model_instance_id": "qwen3-0.6b",
        "load_time_seconds": 1.5,  # its last report's elapsed + the time since
    }
    assert fmt.result()["stats"]["model_load_time_seconds"] == 1.5


def test_a_fast_load_reports_only_its_end() -> None:
    frames, _ = run([load(1000, 1000, 0.0123), Start(0, 1), TextDelta(0, "x", 1)])
    assert datas(frames)[1:4] == [
        {"type": "model_load.start", "model_instance_id": "qwen3-0.6b"},
        {"type": "model_load.progress", "model_instance_id": "qwen3-0.6b", "progress": 1.0},
        {"type": "model_load.end", "model_instance_id": "qwen3-0.6b", "load_time_seconds": 0.012},
    ]


def test_no_load_no_load_time() -> None:
    _, fmt = run([Start(0, 1), TextDelta(0, "x", 1), finish(1, 1)])
    assert "model_load_time_seconds" not in fmt.result()["stats"]


def test_prompt_processing_counts_cached_tokens_as_done() -> None:
    frames, _ = run(
        [
            Start(0, 100),
            pp(40, 100, cached=40),  # admitted with 40 tokens from the cache
            pp(60, 100, cached=40),
            pp(60, 100, cached=40),  # a repeat: dropped
            pp(50, 100, cached=40),  # backwards: dropped
            pp(100, 100, cached=40),
            pp(100, 100, cached=40),  # after the end, before output: nothing
            TextDelta(0, "x", 1),
            finish(100, 1),
        ]
    )
    assert datas(frames)[1:6] == [
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 0.4},
        {"type": "prompt_processing.progress", "progress": 0.6},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
    ]
    # A backend whose done leaves the cached tokens out: the same fraction.
    frames, _ = run([Start(0, 100), pp(0, 100, cached=40), pp(100, 100, cached=40)])
    assert datas(frames)[2] == {"type": "prompt_processing.progress", "progress": 0.4}


def test_a_prompt_without_its_end_is_ended_before_the_output() -> None:
    frames, _ = run([Start(0, 10), pp(0, 10), pp(5, 10), TextDelta(0, "x", 1), finish(10, 1)])
    assert datas(frames)[1:5] == [
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 0.5},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
    ]


def test_a_prompt_reported_before_its_start_is_that_rounds() -> None:
    frames, _ = run([pp(0, 4), pp(4, 4), Start(0, 4), TextDelta(0, "x", 1), finish(4, 1)])
    assert kinds(frames) == [
        "chat.start",
        *PROMPT_DONE,
        "message.start",
        "message.delta",
        "message.end",
        "chat.end",
    ]


def test_an_empty_round_then_another() -> None:
    frames, _ = run([Start(0, 3), finish(3, 0, "tool_calls"), Start(0, 5), pp(0, 5), pp(5, 5)])
    assert kinds(frames) == ["chat.start", *PROMPT_DONE, *PROMPT_DONE, "chat.end"]


def test_an_upstream_stream_without_progress_gets_the_same_shape() -> None:
    frames, fmt = run(
        [
            0.3,
            Start(0, 0),
            0.2,
            TextDelta(0, "Hello", 1),
            0.25,
            TextDelta(0, " world", 1),
            finish(12, 2),
        ]
    )
    assert kinds(frames) == [
        "chat.start",
        *PROMPT_DONE,
        "message.start",
        "message.delta",
        "message.delta",
        "message.end",
        "chat.end",
    ]
    assert frames[2].data == {"type": "prompt_processing.progress", "progress": 1.0}
    assert fmt.result()["stats"] == {
        "input_tokens": 12,  # from the usage: the upstream's Start knew none
        "total_output_tokens": 2,
        "reasoning_output_tokens": 0,
        "tokens_per_second": 8.0,
        "time_to_first_token_seconds": 0.5,  # from the formatter's creation
    }


def test_an_empty_round_still_reports_its_prompt() -> None:
    frames, fmt = run([Start(0, 3), finish(3, 0)])
    assert kinds(frames) == ["chat.start", *PROMPT_DONE, "chat.end"]
    assert fmt.result()["output"] == []
    assert fmt.result()["stats"]["tokens_per_second"] == 0.0
    assert fmt.result()["stats"]["time_to_first_token_seconds"] == 0.0


# -- tool rounds ------------------------------------------------------------------------


def tool_rounds() -> list[Step]:
    return [
        # round 1: reasoning, a good call, a call of an unknown tool
        Start(0, 20),
        pp(0, 20),
        0.1,
        pp(20, 20),
        0.4,
        ReasoningDelta(0, "Need add."),
        TextDelta(0, "", 3),
        0.1,
        ToolCallStart(0, 0, "call_1", "add"),
        ToolCallDelta(0, 0, '{"a": 1,'),
        ToolCallDelta(0, 0, ' "b": 2}'),
        TextDelta(0, "", 9),  # the call's markup tokens
        ToolCallEnd(0, 0),
        ToolCallStart(0, 1, "call_2", "open_browser"),
        ToolCallDelta(0, 1, "{}"),
        TextDelta(0, "", 4),
        ToolCallEnd(0, 1),
        finish(20, 16, "tool_calls"),
        1.0,  # the tools run
        ToolResult(
            0, 0, "add", {"a": 1, "b": 2}, output='[{"type":"text","text":"3"}]', provider=CALC
        ),
        ToolResult(
            0,
            1,
            "open_browser",
            {},
            failure="invalid_name",
            reason="Cannot find tool with name open_browser.",
        ),
        # round 2: a call whose arguments are not an object
        Start(0, 60),
        pp(20, 60, cached=20),
        pp(60, 60, cached=20),
        0.5,
        ToolCallStart(0, 0, "call_3", "search"),
        ToolCallDelta(0, 0, "[1, 2]"),
        TextDelta(0, "", 6),
        ToolCallEnd(0, 0),
        finish(60, 6, "tool_calls"),
        ToolResult(
            0,
            0,
            "search",
            None,
            failure="invalid_arguments",
            reason="Arguments are not a JSON object.",
            provider=WEB,
        ),
        # round 3: the answer (an upstream-like round: no prompt progress)
        Start(0, 90),
        0.5,
        TextDelta(0, "1 + 2 = 3", 5),
        finish(90, 5),
    ]


def test_two_tool_rounds() -> None:
    frames, fmt = run(tool_rounds(), providers={"add": CALC, "search": WEB})
    args = {"a": 1, "b": 2}
    output = '[{"type":"text","text":"3"}]'
    invalid_name = {
        "type": "tool_call.failure",
        "reason": "Cannot find tool with name open_browser.",
        "metadata": {"type": "invalid_name", "tool_name": "open_browser"},
    }
    invalid_args = {
        "type": "tool_call.failure",
        "reason": "Arguments are not a JSON object.",
        "metadata": {"type": "invalid_arguments", "tool_name": "search", "provider_info": WEB},
    }
    assert datas(frames) == [
        {"type": "chat.start", "model_instance_id": "qwen3-0.6b"},
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
        {"type": "reasoning.start"},
        {"type": "reasoning.delta", "content": "Need add."},
        {"type": "reasoning.end"},
        {"type": "tool_call.start", "tool": "add", "provider_info": CALC},
        {"type": "tool_call.arguments", "tool": "add", "arguments": args, "provider_info": CALC},
        # open_browser: unknown, so nothing until its result
        {
            "type": "tool_call.success",
            "tool": "add",
            "arguments": args,
            "output": output,
            "provider_info": CALC,
        },
        invalid_name,
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 20 / 60},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
        {"type": "tool_call.start", "tool": "search", "provider_info": WEB},
        # no tool_call.arguments: "[1, 2]" is not an object
        invalid_args,
        {"type": "prompt_processing.start"},
        {"type": "prompt_processing.progress", "progress": 1.0},
        {"type": "prompt_processing.end"},
        {"type": "message.start"},
        {"type": "message.delta", "content": "1 + 2 = 3"},
        {"type": "message.end"},
        {"type": "chat.end", "result": fmt.result()},
    ]
    result = fmt.result()
    assert result["output"] == [
        {"type": "reasoning", "content": "Need add."},
        {
            "type": "tool_call",
            "tool": "add",
            "arguments": args,
            "output": output,
            "provider_info": CALC,
        },
        {"type": "invalid_tool_call", **{k: v for k, v in invalid_name.items() if k != "type"}},
        {"type": "invalid_tool_call", **{k: v for k, v in invalid_args.items() if k != "type"}},
        {"type": "message", "content": "1 + 2 = 3"},
    ]
    assert result["stats"] == {
        "input_tokens": 90,  # the last round's prompt
        "total_output_tokens": 27,  # 16 + 6 + 5
        "reasoning_output_tokens": 3,
        # first token at +0.5 (round 1), last at +2.6 (round 3), tool time included:
        # 27 / 2.1
        "tokens_per_second": 12.86,
        "time_to_first_token_seconds": 0.5,
    }


def test_tool_call_output_item_key_order() -> None:
    _, fmt = run(tool_rounds(), providers={"add": CALC, "search": WEB})
    call = fmt.result()["output"][1]
    assert list(call) == ["type", "tool", "arguments", "output", "provider_info"]
    failure = fmt.result()["output"][3]
    assert list(failure) == ["type", "reason", "metadata"]


def test_a_tool_error_carries_the_arguments_and_provider() -> None:
    frames, fmt = run(
        [
            Start(0, 5),
            TextDelta(0, "Looking.", 2),
            ToolCallStart(0, 0, "c1", "add"),
            ToolCallDelta(0, 0, '{"a": 1}'),
            ToolCallEnd(0, 0),
            finish(5, 8, "tool_calls"),
            ToolResult(
                0, 0, "add", {"a": 1}, failure="tool_error", reason="timed out", provider=CALC
            ),
        ],
        providers={"add": CALC},
    )
    assert kinds(frames)[4:] == [
        "message.start",
        "message.delta",
        "message.end",  # closed before the tool call's events
        "tool_call.start",
        "tool_call.arguments",
        "tool_call.failure",
        "chat.end",
    ]
    assert frames[-2].data == {
        "type": "tool_call.failure",
        "reason": "timed out",
        "metadata": {
            "type": "tool_error",
            "tool_name": "add",
            "arguments": {"a": 1},
            "provider_info": CALC,
        },
    }
    assert fmt.result()["output"][0] == {"type": "message", "content": "Looking."}


def test_a_result_the_model_events_did_not_announce_gets_start_and_arguments() -> None:
    frames, _ = run(
        [Start(0, 1), ToolResult(0, 0, "add", {"a": 1}, output="2", provider=CALC)],
    )
    assert kinds(frames)[1:] == [
        "tool_call.start",
        "tool_call.arguments",
        "tool_call.success",
        "chat.end",
    ]


# -- errors -------------------------------------------------------------------------------


def test_an_error_mid_message_closes_the_block_then_error_then_chat_end() -> None:
    clock = Clock()
    fmt = formatter(clock, response_id="resp_1")
    frames = feed(fmt, clock, [Start(0, 4), pp(0, 4), pp(4, 4), 0.5, TextDelta(0, "Hal", 2)])
    frames += fmt.error(EngineFailure("decode failed"))
    check_end(frames, fmt)
    assert datas(frames)[-4:] == [
        {"type": "message.delta", "content": "Hal"},
        {"type": "message.end"},
        {
            "type": "error",
            "error": {"type": "internal_error", "message": "decode failed", "code": "engine_error"},
        },
        {"type": "chat.end", "result": fmt.result()},
    ]
    assert frames[-2].ascii  # the message may quote the client's input
    result = fmt.result()
    assert result["output"] == [{"type": "message", "content": "Hal"}]
    assert result["stats"]["total_output_tokens"] == 2  # the unfinished round's deltas
    assert result["response_id"] == "resp_1"


def test_an_error_event_with_a_param_and_a_plain_exception() -> None:
    frames, fmt = run([])  # nothing generated
    assert kinds(frames) == ["chat.start", "chat.end"]

    clock = Clock()
    fmt = formatter(clock)
    frames = fmt.frames(ErrorEvent(InvalidRequest("bad", param="input")))
    assert datas(frames) == [
        {"type": "chat.start", "model_instance_id": "qwen3-0.6b"},
        {
            "type": "error",
            "error": {
                "type": "invalid_request",
                "message": "bad",
                "code": "invalid_request",
                "param": "input",
            },
        },
        {"type": "chat.end", "result": fmt.result()},
    ]
    assert fmt.frames(TextDelta(0, "late", 1)) == []

    fmt = formatter(clock)
    frames = fmt.error(ValueError("boom"))
    assert frames[1].data == {
        "type": "error",
        "error": {"type": "internal_error", "message": "ValueError: boom", "code": "engine_error"},
    }


def test_a_failed_load_has_no_end_and_no_load_time() -> None:
    clock = Clock()
    fmt = formatter(clock)
    frames = feed(fmt, clock, [load(0, 100, 0.0), load(40, 100, 0.4)])
    frames += fmt.error(ModelLoadFailed("bad file"))
    check_end(frames, fmt)
    assert kinds(frames) == [
        "chat.start",
        "model_load.start",
        "model_load.progress",
        "error",
        "chat.end",
    ]
    assert "model_load_time_seconds" not in fmt.result()["stats"]


def test_result_before_the_end_changes_no_frame() -> None:
    """The route stores the turn (reading result()) before it sends the closing frames."""
    clock = Clock()
    fmt = formatter(clock)
    frames = feed(fmt, clock, [Start(0, 2), ReasoningDelta(0, "hm"), TextDelta(0, "", 1)])
    early = fmt.result()
    assert early["output"] == [{"type": "reasoning", "content": "hm"}]
    frames += fmt.end()
    check_end(frames, fmt)
    assert kinds(frames)[-2:] == ["reasoning.end", "chat.end"]
    assert fmt.result() == early


def test_a_response_id_cleared_before_the_end_is_left_out() -> None:
    """The route clears it when storing the response failed: nothing to continue from."""
    clock = Clock()
    fmt = formatter(clock, response_id="resp_1")
    frames = feed(fmt, clock, [Start(0, 1), TextDelta(0, "x", 1), finish(1, 1)])
    assert fmt.result()["response_id"] == "resp_1"
    fmt.response_id = None
    frames += fmt.end()
    check_end(frames, fmt)
    assert "response_id" not in fmt.result()
