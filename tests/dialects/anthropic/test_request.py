"""Anthropic request bodies -> the neutral request: blocks, tools, choices, and a 400 that
names the block for everything sluice cannot take."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.core.errors import InvalidRequest
from sluice.dialects.anthropic.schema import CountTokensRequest, MessagesRequest, parse

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }


def neutral(**extra: Any) -> Any:
    return parse(body(**extra), MessagesRequest).to_request()


def bad(data: dict[str, Any], model: type = MessagesRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(data, model).to_request()
    return info.value


def test_a_plain_request() -> None:
    req = neutral(temperature=0.2, top_k=5, stop_sequences=["END"])
    assert req.model == "smollm2"
    assert req.messages == [{"role": "user", "content": "Hi"}]
    assert req.max_tokens == 32
    assert req.stop == ("END",)
    assert (req.sampling.temperature, req.sampling.top_k) == (0.2, 5)
    assert req.tools is None and req.tool_choice is None


def test_system_as_text_blocks_and_between_turns_joins_the_system_prompt() -> None:
    req = neutral(
        system=[
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer in English."},
        ],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Agents: none."},  # Claude Code sends these
            {"role": "assistant", "content": "Hello"},
        ],
    )
    assert req.messages == [
        {"role": "system", "content": "You are terse.\n\nAnswer in English.\n\nAgents: none."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]


def test_a_tool_round_trip_in_the_history() -> None:
    req = neutral(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "opaque"},
                    {"type": "text", "text": "Let me check."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no such city"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks!"},
                ],
            },
        ],
    )
    assert req.messages[1] == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert req.messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "Thanks!"},
    ]
    assert json.loads(req.messages[1]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"
    }


def test_tools_and_tool_choice() -> None:
    req = neutral(tools=[WEATHER])
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather for a city",
            },
        }
    ]
    assert req.tool_choice == "auto"
    assert neutral(tools=[WEATHER], tool_choice={"type": "any"}).tool_choice == "required"
    assert neutral(tools=[WEATHER], tool_choice={"type": "none"}).tool_choice == "none"
    named = neutral(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    single = neutral(
        tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    assert single.parallel_tool_calls is False


def test_anthropic_server_tools_are_left_out() -> None:
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    assert neutral(tools=[search]).tools is None
    assert neutral(tools=[search, WEATHER]).tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [{"name": "x", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
        ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)
def test_bad_tools_name_the_field(extra: dict[str, Any], param: str) -> None:
    assert bad(body(**extra)).param == param


@pytest.mark.parametrize(
    ("content", "where", "kind"),
    [
        ([{"type": "document", "source": {}}], "messages[0].content[0]", "document"),
        ([{"type": "text", "text": "a"}, {"type": "video"}], "messages[0].content[1]", "video"),
        (
            [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "search_result"}]}],
            "messages[0].content[0].content[0]",
            "search_result",
        ),
    ],
)
def test_an_unknown_block_is_a_400_naming_it(content: list[Any], where: str, kind: str) -> None:
    error = bad(body(messages=[{"role": "user", "content": content}]))
    assert error.param == f"{where}.type"
    assert f"'{kind}'" in error.message and where in error.message


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"text": "no type"}], "messages[0].content[0].type"),
        (["a string, not a block"], "messages[0].content"),
        ([{"type": "text", "text": 7}], "messages[0].content[0].text"),
        ([{"type": "tool_result", "content": "x"}], "messages[0].content[0].tool_use_id"),
        ([{"type": "image", "source": {"type": "file"}}], "messages[0].content[0].source.type"),
    ],
)
def test_malformed_blocks_name_their_field(content: list[Any], param: str) -> None:
    assert bad(body(messages=[{"role": "user", "content": content}])).param == param


def test_assistant_blocks_are_checked_too() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}],
        },
    ]
    assert bad(body(messages=messages)).param == "messages[1].content[0].input"
    messages[1]["content"] = [{"type": "image", "source": {}}]
    assert "'image'" in bad(body(messages=messages)).message


def test_images_become_openai_parts_for_an_upstream() -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
    }
    parsed = parse(
        body(
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
        ),
        MessagesRequest,
    )
    assert parsed.has_images()
    assert parsed.to_request().messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    assert not parse(body(), MessagesRequest).has_images()


def test_what_clients_send_back_and_sluice_needs_not_is_dropped() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "..."},
                {"type": "text", "text": "Yo"},
            ],
        },
    ]
    assert neutral(messages=messages).messages[1] == {"role": "assistant", "content": "Yo"}


def test_thinking_and_structured_output() -> None:
    assert neutral(thinking={"type": "enabled", "budget_tokens": 1024}).template_kwargs == {
        "enable_thinking": True
    }
    assert neutral(thinking={"type": "adaptive"}).template_kwargs == {"enable_thinking": True}
    assert neutral(thinking={"type": "disabled"}).template_kwargs == {"enable_thinking": False}
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    req = neutral(
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}}
    )
    assert req.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_what_claude_code_sends_is_accepted() -> None:
    req = neutral(
        metadata={"user_id": '{"device_id": "x"}'},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        thinking={"type": "adaptive"},
        max_tokens=32000,
        stream=True,
    )
    assert req.max_tokens == 32000  # the context, not the request, ends the answer


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (body(max_tokens=0), "max_tokens"),
        (body(messages=[]), "messages"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
def test_required_fields(data: dict[str, Any], param: str) -> None:
    assert bad(data).param == param


def test_count_tokens_takes_the_prompt_without_max_tokens() -> None:
    parsed = parse(
        {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "tools": []},
        CountTokensRequest,
    )
    req = parsed.to_request()
    assert req.messages == [{"role": "user", "content": "Hi"}]
    assert req.tools is None
