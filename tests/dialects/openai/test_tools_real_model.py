"""Tool calls, structured output and tool conversations on the real SmolLM2.

SmolLM2's template has no tool support, so these run the generic format:
tools described in a system prompt, calls constrained by a grammar.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.support.tools import SEARCH, WEATHER

pytestmark = pytest.mark.integration

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}

PROMPTS = [
    "What's the weather in Tokyo?",
    "Is it raining in Paris right now?",
    "Temperature in New York in fahrenheit please.",
    "How cold is it in Oslo?",
    "Find me books about dragons.",
    "I need three novels by Jane Austen.",
    "Weather for Cairo, Egypt.",
    "Look up books on quantum physics, max 5.",
    "Do I need an umbrella in London today?",
    "Search for cookbooks with Italian recipes.",
    "What's it like outside in Sydney?",
    "Any good mystery books?",
    "Tell me the weather in Reykjavik in celsius.",
    "Books about the history of Rome, 10 results.",
    "Is it sunny in Madrid?",
    "Recommend a book on gardening.",
    "Weather check: Buenos Aires.",
    "Find programming books for beginners.",
    "How hot is Dubai today?",
    "¿Qué tiempo hace en México?",
]


def _stream_calls(client: OpenAI, **kwargs: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                # First delta of a call: index, id, type, name and arguments "".
                assert tc.id and tc.type == "function" and tc.function and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and (tc.function is None or tc.function.name is None)
                assert tc.function is not None and tc.function.arguments
                calls[tc.index]["arguments"] += tc.function.arguments
        if choice.finish_reason is not None:
            finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls)))  # dense indexes
    return [calls[i] for i in sorted(calls)], finish, content


def test_required_tool_choice_always_yields_valid_calls(client: OpenAI, model_id: str) -> None:
    valid = 0
    for i, prompt in enumerate(PROMPTS):
        calls, finish, content = _stream_calls(
            client,
            model=model_id,
            messages=[{"role": "user", "content": prompt}],
            tools=[WEATHER, SEARCH],
            tool_choice="required",
            temperature=0.7,
            seed=i,
            max_tokens=160,
        )
        assert finish == "tool_calls", (prompt, calls, content)
        assert calls and content == ""
        assert len({c["id"] for c in calls}) == len(calls)
        for call in calls:
            args = json.loads(call["arguments"])
            jsonschema.validate(args, SCHEMAS[call["name"]])
        valid += 1
    assert valid == len(PROMPTS)


def test_named_tool_choice_streamed_equals_non_streamed(client: OpenAI, model_id: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Find books about whales."}],
        "tools": [WEATHER, SEARCH],
        "tool_choice": {"type": "function", "function": {"name": "search_books"}},
        "temperature": 0,
        "max_tokens": 160,
    }
    calls, finish, _ = _stream_calls(client, **kwargs)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls is not None and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert all(c["name"] == "search_books" for c in calls)
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["search_books"])


def test_json_schema_response_format_validates(client: OpenAI, model_id: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "hobbies": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    for stream in (False, True):
        for seed in range(3):
            kwargs: dict[str, Any] = {
                "model": model_id,
                "messages": [{"role": "user", "content": "Describe a person as JSON."}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema, "strict": True},
                },
                "temperature": 0.8,
                "seed": seed,
                "max_tokens": 200,
            }
            if stream:
                text = "".join(
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(stream=True, **kwargs)
                    if c.choices
                )
            else:
                text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
            jsonschema.validate(json.loads(text), schema)


def test_json_object_response_format(client: OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(
        model=model_id,
        # A small object: on an open-ended ask the 135M model counts up forever.
        messages=[
            {
                "role": "user",
                "content": "Reply with a small JSON object with keys name and color for a cat.",
            }
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


def test_invalid_schema_is_400(client: OpenAI, model_id: str) -> None:
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "x"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
            },
        )


def test_two_turn_tool_conversation_completes(client: OpenAI, model_id: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Tokyo?"}]
    first = client.chat.completions.create(
        model=model_id,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        }
    )
    messages.append(
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 21, "condition": "sunny"}),
        }
    )
    second = client.chat.completions.create(
        model=model_id,
        messages=messages,
        tools=[WEATHER],
        temperature=0,
        max_tokens=60,
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or "")


def test_tool_choice_none_gives_plain_content(client: OpenAI, model_id: str) -> None:
    out = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Say hi."}],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=20,
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")
