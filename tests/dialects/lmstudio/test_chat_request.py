"""LM Studio's /api/v1/chat request body: parsing, validation errors naming the field,
input items, the neutral request, and the reasoning switch."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sluice.core.errors import InvalidRequest, ReasoningUnsupported, lmstudio_error_body
from sluice.core.request import SamplingParams
from sluice.dialects.lmstudio.schema import (
    ChatRequest,
    parse,
    reasoning_switch,
)
from sluice.models.files import reasoning_capability

PNG = "data:image/png;base64,iVBORw0KGgo="
SWITCHABLE = {"allowed_options": ["off", "on"], "default": "on"}
ALWAYS = {"allowed_options": ["on"], "default": "on"}


def chat(**fields: Any) -> ChatRequest:
    return parse({"model": "qwen3", "input": "Hi", **fields}, ChatRequest)


# -- parsing ------------------------------------------------------------------------------


def test_defaults() -> None:
    body = chat()
    assert body.model == "qwen3" and body.input == "Hi"
    assert body.stream is False and body.store is True
    assert body.system_prompt is None and body.integrations is None
    assert body.reasoning is None and body.tool_choice is None
    assert body.previous_response_id is None and body.context_length is None


def test_all_fields() -> None:
    body = chat(
        system_prompt="Be brief.",
        integrations=["mcp/calc", {"type": "ephemeral_mcp", "server_label": "x"}],
        stream=True,
        temperature=0.2,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repeat_penalty=1.1,
        max_output_tokens=64,
        reasoning="off",
        context_length=4096,
        store=False,
        previous_response_id="resp_0123",
        tool_choice="required",
    )
    assert body.integrations == ["mcp/calc", {"type": "ephemeral_mcp", "server_label": "x"}]
    assert (body.stream, body.store, body.reasoning) == (True, False, "off")
    assert (body.max_output_tokens, body.context_length) == (64, 4096)
    assert body.previous_response_id == "resp_0123" and body.tool_choice == "required"


def test_unknown_fields_are_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sluice.api"):
        body = chat(ttl=300, draft_model="x")
    assert body.unknown_fields() == ["draft_model", "ttl"]
    assert "draft_model, ttl" in caplog.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"input": None}, "input"),
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "audio", "content": "x"}]}, "input[0]"),
        ({"input": [{"content": "x"}]}, "input[0]"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"type": "message"}]}, "input[0].content"),
        ({"input": [{"type": "text", "content": 3}]}, "input[0].content"),
        ({"input": [{"type": "message", "content": "a"}, {"type": "image"}]}, "input[1].data_url"),
        ({"input": [{"type": "image", "data_url": "https://x/cat.png"}]}, "input[0].data_url"),
        (
            {"input": [{"type": "image", "data_url": "data:text/plain;base64,eA=="}]},
            "input[0].data_url",
        ),
        ({"stream": "sometimes"}, "stream"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": "max"}, "reasoning"),
        ({"context_length": 10}, "context_length"),
        ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
        ({"previous_response_id": 7}, "previous_response_id"),
        ({"tool_choice": "function"}, "tool_choice"),
        ({"integrations": "mcp/calc"}, "integrations"),
    ],
)
def test_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    data = {"model": "qwen3", "input": "Hi", **fields}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(InvalidRequest) as exc:
        parse(data, ChatRequest)
    assert exc.value.param == param
    assert exc.value.message.startswith(f"Invalid '{param}': ")
    body = lmstudio_error_body(exc.value)["error"]
    assert (body["type"], body["param"]) == ("invalid_request", param)


def test_error_messages_speak_of_the_branch_the_client_meant() -> None:
    with pytest.raises(InvalidRequest) as exc:
        chat(input=3)
    assert exc.value.message == "Invalid 'input': Input should be a string or a list of input items"
    with pytest.raises(InvalidRequest) as exc:
        chat(input=[{"type": "image", "data_url": "https://x/cat.png"}])
    assert "data:image/<format>;base64,<data>" in exc.value.message
    assert "valid string" not in exc.value.message


# -- input and the neutral request -------------------------------------------------------


def test_input_messages() -> None:
    assert chat(input="Hi").input_messages() == [{"role": "user", "content": "Hi"}]
    text_only = chat(
        input=[{"type": "message", "content": "Hello, "}, {"type": "text", "content": "there"}]
    )
    assert text_only.input_messages() == [{"role": "user", "content": "Hello, there"}]
    assert not text_only.has_images()
    mixed = chat(
        input=[{"type": "text", "content": "What is this?"}, {"type": "image", "data_url": PNG}]
    )
    assert mixed.input_messages() == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": PNG}},
            ],
        }
    ]
    assert mixed.has_images()


def test_to_request_orders_system_history_input() -> None:
    history = [
        {"role": "user", "content": "Earlier"},
        {"role": "assistant", "content": "Reply", "reasoning_content": "hm"},
    ]
    request = chat(system_prompt="Be brief.").to_request(history, None)
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        *history,
        {"role": "user", "content": "Hi"},
    ]
    assert request.model == "qwen3" and request.is_chat
    assert request.tools is None and request.tool_choice is None
    assert request.max_tokens is None and request.template_kwargs is None
    assert request.reasoning_effort is None
    assert request.sampling == SamplingParams()  # nothing set: the engine's neutral defaults
    assert history == [  # not modified
        {"role": "user", "content": "Earlier"},
        {"role": "assistant", "content": "Reply", "reasoning_content": "hm"},
    ]
    assert chat().to_request([], None).messages == [{"role": "user", "content": "Hi"}]


def test_to_request_sampling_limits_tools() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    body = chat(
        temperature=0.0,
        top_p=0.5,
        top_k=2**40,
        min_p=0.1,
        repeat_penalty=1.3,
        max_output_tokens=32,
        tool_choice="required",
    )
    request = body.to_request([], tools, template_kwargs={"enable_thinking": False})
    assert request.sampling == SamplingParams(
        temperature=0.0, top_p=0.5, top_k=2**31 - 1, min_p=0.1, repeat_penalty=1.3
    )
    assert request.max_tokens == 32
    assert request.tools == tools and request.tool_choice == "required"
    assert request.template_kwargs == {"enable_thinking": False}
    assert chat().to_request([], []).tools is None  # no tools at all: none offered


def test_a_reasoning_level_travels_as_reasoning_effort() -> None:
    assert chat(reasoning="high").to_request([], None).reasoning_effort == "high"
    assert chat(reasoning="on").to_request([], None).reasoning_effort is None


# -- reasoning -----------------------------------------------------------------------------


def test_reasoning_capability_follows_the_template_switch() -> None:
    assert reasoning_capability("<think>{% if enable_thinking %}{% endif %}") == SWITCHABLE
    assert reasoning_capability("<think>") == ALWAYS
    assert reasoning_capability("{{ messages }}") is None


@pytest.mark.parametrize(
    ("value", "capability", "expected"),
    [
        (None, None, None),
        (None, SWITCHABLE, None),
        ("off", None, None),  # a model that does not reason is off already
        ("off", SWITCHABLE, {"enable_thinking": False}),
        ("on", SWITCHABLE, {"enable_thinking": True}),
        ("on", ALWAYS, None),  # it thinks anyway: no switch to set
        ("low", {"allowed_options": ["low", "medium", "high"], "default": "medium"}, None),
        (
            "low",
            {"allowed_options": ["off", "low", "high"], "default": "low"},
            {"enable_thinking": True},
        ),
    ],
)
def test_reasoning_switch(
    value: str | None, capability: dict[str, Any] | None, expected: dict[str, Any] | None
) -> None:
    assert reasoning_switch(value, capability) == expected


@pytest.mark.parametrize(
    ("value", "capability", "allowed"),
    [
        ("on", None, "'off'"),
        ("high", None, "'off'"),
        ("off", ALWAYS, "'on'"),
        ("low", SWITCHABLE, "'off', 'on'"),
        ("medium", SWITCHABLE, "'off', 'on'"),
    ],
)
def test_reasoning_switch_refuses_what_the_model_cannot(
    value: str, capability: dict[str, Any] | None, allowed: str
) -> None:
    with pytest.raises(ReasoningUnsupported) as exc:
        reasoning_switch(value, capability, model="gemma-3-270m")
    assert exc.value.param == "reasoning"
    assert exc.value.message == (
        f"Model 'gemma-3-270m' does not support reasoning '{value}'; allowed: {allowed}"
    )
    body = lmstudio_error_body(exc.value)["error"]
    assert body == {
        "type": "invalid_request",
        "message": exc.value.message,
        "code": "reasoning_not_supported",
        "param": "reasoning",
    }
    with pytest.raises(ReasoningUnsupported, match="^This model does not support"):
        reasoning_switch(value, capability)
