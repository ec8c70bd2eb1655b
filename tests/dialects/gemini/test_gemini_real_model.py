"""Google's Gemini API on the real SmolLM2 through Google's official ``google-genai`` SDK
(a base URL at sluice): on the local model, on an upstream model (a second sluice in
front of the first, translating through the neutral request), and on an upstream that
speaks the Gemini API itself (slot ``native``, whose bytes pass through unchanged,
recorded by a relay and compared)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import types

from tests.support.relay import Relay
from tests.support.servers import gateway_in_front

pytestmark = pytest.mark.integration

MODELS = ["smollm2", "up-smollm2", "native-smollm2"]


def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: the city's name
    """
    return f"Sunny in {city}, 21 C."


@pytest.fixture(scope="module")
def upstream(relay: Relay) -> Iterator[str]:
    with gateway_in_front(relay.url, native_apis=("gemini",)) as front:
        yield front


def client(url: str) -> genai.Client:
    return genai.Client(
        api_key="unused", http_options=types.HttpOptions(base_url=url, api_version="v1beta")
    )


def at(base: str, upstream: str, model: str) -> genai.Client:
    return client(base if model == "smollm2" else upstream)


@pytest.mark.parametrize("model", MODELS)
def test_generate_stream_and_count(base: str, upstream: str, model: str) -> None:
    c = at(base, upstream, model)
    config = types.GenerateContentConfig(max_output_tokens=16, temperature=0)
    whole = c.models.generate_content(model=model, contents="Say hello.", config=config)
    assert whole.text and whole.candidates and whole.candidates[0].finish_reason
    usage = whole.usage_metadata
    assert usage is not None and usage.prompt_token_count and usage.candidates_token_count
    chunks = list(
        c.models.generate_content_stream(model=model, contents="Say hello.", config=config)
    )
    assert "".join(ch.text or "" for ch in chunks) == whole.text  # greedy: the same answer
    assert chunks[-1].candidates and chunks[-1].candidates[0].finish_reason is not None
    counted = c.models.count_tokens(model=model, contents="Say hello.")
    assert counted.total_tokens == usage.prompt_token_count


@pytest.mark.parametrize("model", MODELS)
def test_a_required_call_and_its_answer(base: str, upstream: str, model: str) -> None:
    c = at(base, upstream, model)
    declared = types.FunctionDeclaration(
        name="get_weather",
        description="The current weather in a city.",
        parameters=types.Schema(
            type=types.Type.OBJECT,
            properties={"city": types.Schema(type=types.Type.STRING)},
            required=["city"],
        ),
    )
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[declared])],
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY
            )
        ),
        max_output_tokens=64,
        temperature=0,
    )
    asked = types.Content(role="user", parts=[types.Part(text="What is the weather in Paris?")])
    first = c.models.generate_content(model=model, contents=[asked], config=config)
    calls = first.function_calls or []
    assert [call.name for call in calls] == ["get_weather"], first
    assert isinstance(calls[0].args, dict) and isinstance(calls[0].args.get("city"), str)
    # The call and its result go back; the model answers in text.
    assert first.candidates and first.candidates[0].content
    result = types.Part.from_function_response(name="get_weather", response={"result": "Sunny"})
    answer = c.models.generate_content(
        model=model,
        contents=[asked, first.candidates[0].content, types.Content(role="user", parts=[result])],
        config=types.GenerateContentConfig(max_output_tokens=24, temperature=0),
    )
    assert answer.text


def test_automatic_function_calling_runs_the_python_function(base: str) -> None:
    """The SDK's automatic mode: it declares get_weather from the Python function, calls
    it when the model asks and sends the result back (two requests: the second, under
    mode ANY, asks for a call again, which the SDK then returns to the caller)."""
    c = client(base)
    config = types.GenerateContentConfig(
        tools=[get_weather],
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY
            )
        ),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(maximum_remote_calls=2),
        max_output_tokens=48,
        temperature=0,
    )
    response = c.models.generate_content(
        model="smollm2", contents="What is the weather in Paris?", config=config
    )
    history: Any = response.automatic_function_calling_history or []
    called = [p.function_call.name for h in history for p in (h.parts or []) if p.function_call]
    answered = [p for h in history for p in (h.parts or []) if p.function_response]
    assert called == ["get_weather"] and answered, history


@pytest.mark.parametrize("model", MODELS)
def test_json_output_with_a_schema(base: str, upstream: str, model: str) -> None:
    c = at(base, upstream, model)
    schema = types.Schema(
        type=types.Type.OBJECT,
        properties={
            "name": types.Schema(type=types.Type.STRING),
            "age": types.Schema(type=types.Type.INTEGER),
        },
        required=["name", "age"],
    )
    config = types.GenerateContentConfig(
        response_mime_type="application/json",
        response_schema=schema,
        max_output_tokens=64,
        temperature=0,
    )
    out = c.models.generate_content(model=model, contents="A person, as JSON.", config=config)
    value = json.loads(out.text or "")
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


@pytest.mark.parametrize("model", MODELS)
def test_embed_content(base: str, upstream: str, model: str) -> None:
    c = at(base, upstream, model)
    out = c.models.embed_content(model=model, contents=["hello", "a second text"])
    vectors = [e.values or [] for e in out.embeddings or []]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 100
    assert vectors[0] != vectors[1]


def test_native_passthrough_is_byte_for_byte(base: str, upstream: str, relay: Relay) -> None:
    body = {
        "contents": [{"role": "user", "parts": [{"text": "Say hello."}]}],
        "generationConfig": {"maxOutputTokens": 12, "temperature": 0},
    }
    url = f"{upstream}/v1beta/models/native-smollm2"
    for method in ("generateContent", "streamGenerateContent?alt=sse", "streamGenerateContent"):
        r = httpx.post(f"{url}:{method}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-sluice-slot"] == f"native; replica={relay.url}"
        assert relay.sent(r.content), f"{method}: the body is not what the upstream sent"
    # A translated slot's answer is the gateway's own, decoded and re-encoded.
    up = httpx.post(f"{upstream}/v1beta/models/up-smollm2:generateContent", json=body, timeout=60)
    assert up.status_code == 200 and up.json()["modelVersion"] == "up-smollm2"
