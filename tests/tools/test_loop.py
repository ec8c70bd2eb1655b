"""The tool loop: rounds, checks of the model's calls, what goes back to the model, limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice.core.backend import StreamMeta
from sluice.core.errors import EngineFailure, ToolRoundsExceeded
from sluice.core.events import (
    ErrorEvent,
    Event,
    Finish,
    Start,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolResult,
    Usage,
)
from sluice.core.request import GenerationRequest
from sluice.tools.loop import ToolLoop
from sluice.tools.mcp import ToolCallFailed, ToolSpec

META = StreamMeta("m", 1, frozenset({0}))
ADD = ToolSpec(
    "add",
    "Add two integers",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    {"type": "ephemeral_mcp", "server_label": "calc"},
)


class FakeStream:
    def __init__(self, events: list[Event]) -> None:
        self.meta = META
        self.events = events
        self.closed = False

    def __aiter__(self) -> AsyncIterator[Event]:
        async def gen() -> AsyncIterator[Event]:
            for e in self.events:
                yield e

        return gen()

    async def aclose(self) -> None:
        self.closed = True


class FakeTools:
    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.specs = [ADD]
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.delay = delay
        self.closed = False

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        self.calls.append((name, arguments))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ToolCallFailed("calc timed out after 1 s")
        return json.dumps([{"type": "text", "text": str(arguments["a"] + arguments["b"])}])

    async def aclose(self) -> None:
        self.closed = True


def calling(name: str, arguments: str, call_id: str = "call_1") -> list[Event]:
    return [
        Start(0, 10),
        ToolCallStart(0, 0, call_id, name),
        ToolCallDelta(0, 0, arguments),
        ToolCallEnd(0, 0),
        Finish(0, "tool_calls", Usage(0, 10, 5)),
    ]


def answering(text: str) -> list[Event]:
    return [Start(0, 30), TextDelta(0, text, 2), Finish(0, "stop", Usage(0, 30, 2))]


REQUEST = GenerationRequest(
    model="m", messages=[{"role": "user", "content": "1+2?"}], tool_choice="required"
)


async def run(
    rounds: list[list[Event]], tools: FakeTools, max_rounds: int = 8
) -> tuple[list[Event], list[GenerationRequest], ToolLoop]:
    streams = [FakeStream(r) for r in rounds]
    asked: list[GenerationRequest] = []

    async def reopen(request: GenerationRequest) -> FakeStream:
        asked.append(request)
        return streams[len(asked)]

    loop = ToolLoop(streams[0], REQUEST, tools, reopen=reopen, max_rounds=max_rounds)
    events = [e async for e in loop]
    await loop.aclose()
    assert all(s.closed for s in streams[: len(asked) + 1])
    return events, asked, loop


async def test_a_call_runs_and_the_model_answers_with_its_output() -> None:
    tools = FakeTools()
    events, asked, loop = await run([calling("add", '{"a": 1, "b": 2}'), answering("3")], tools)
    assert tools.calls == [("add", {"a": 1, "b": 2})]
    results = [e for e in events if isinstance(e, ToolResult)]
    assert results == [
        ToolResult(0, 0, "add", {"a": 1, "b": 2}, output='[{"type": "text", "text": "3"}]',
                   provider=ADD.provider)
    ]  # fmt: skip
    # The result comes after the round's Finish, before the next round's Start.
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("ToolResult") == kinds.index("Finish") + 1
    (second,) = asked
    assert second.tool_choice == "auto"  # forced for the first round only
    assert second.messages == [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "add",
            "content": '[{"type": "text", "text": "3"}]',
        },
    ]
    assert loop.transcript()[-1] == {"role": "assistant", "content": "3"}
    assert len(loop.transcript()) == 3
    assert tools.closed


@pytest.mark.parametrize(
    ("name", "arguments", "failure", "reason"),
    [
        ("open_browser", "{}", "invalid_name", "Cannot find tool with name open_browser."),
        ("add", '{"a": 1', "invalid_arguments", "not a JSON object"),
        ("add", '{"a": "one", "b": 2}', "invalid_arguments", "at ['a']: 'one' is not of type"),
        ("add", '{"a": 1}', "invalid_arguments", "'b' is a required property"),
    ],
)
async def test_bad_calls_are_failures_the_model_is_told_about(
    name: str, arguments: str, failure: str, reason: str
) -> None:
    tools = FakeTools()
    events, asked, _ = await run([calling(name, arguments), answering("sorry")], tools)
    assert tools.calls == []  # never sent to the server
    (result,) = [e for e in events if isinstance(e, ToolResult)]
    assert result.failure == failure and result.output is None
    assert reason in (result.reason or "")
    assert (result.provider is None) == (failure == "invalid_name")
    told = asked[0].messages[-1]  # type: ignore[index]
    assert told["role"] == "tool" and told["content"] == f"Error: {result.reason}"


async def test_a_call_cut_by_the_token_limit_is_a_failure_and_not_run() -> None:
    cut = [Start(0, 10), ToolCallStart(0, 0, "call_1", "add"), ToolCallDelta(0, 0, '{"a": 1'),
           Finish(0, "length", Usage(0, 10, 8))]  # fmt: skip
    tools = FakeTools()
    events, asked, _ = await run([cut], tools)
    assert tools.calls == [] and asked == []
    (result,) = [e for e in events if isinstance(e, ToolResult)]
    assert result.failure == "invalid_arguments" and "max tokens" in (result.reason or "")
    assert result.provider == ADD.provider


async def test_a_failing_server_is_a_tool_error() -> None:
    events, _, _ = await run([calling("add", '{"a": 1, "b": 2}'), answering("x")], FakeTools(True))
    (result,) = [e for e in events if isinstance(e, ToolResult)]
    assert (result.failure, result.reason) == ("tool_error", "calc timed out after 1 s")


async def test_rounds_are_limited() -> None:
    rounds = [calling("add", '{"a": 1, "b": 2}', f"call_{i}") for i in range(3)]
    events, asked, _ = await run(rounds, FakeTools(), max_rounds=2)
    assert len(asked) == 1
    assert isinstance(events[-1], ErrorEvent)
    assert isinstance(events[-1].error, ToolRoundsExceeded)
    assert sum(isinstance(e, ToolResult) for e in events) == 2


async def test_an_error_ends_the_loop() -> None:
    rounds = [[Start(0, 1), ErrorEvent(EngineFailure("boom"))]]
    events, asked, _ = await run(rounds, FakeTools())
    assert asked == [] and isinstance(events[-1], ErrorEvent)


async def test_closing_mid_call_cancels_it_and_closes_the_tools() -> None:
    tools = FakeTools(delay=30)
    first = FakeStream(calling("add", '{"a": 1, "b": 2}'))

    async def reopen(request: GenerationRequest) -> FakeStream:
        raise AssertionError("no second round")

    loop = ToolLoop(first, REQUEST, tools, reopen=reopen, max_rounds=8)

    async def consume() -> None:
        async for _ in loop:
            pass

    task = asyncio.ensure_future(consume())
    while not tools.calls:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await loop.aclose()
    assert tools.closed and first.closed
