"""Ollama's API on the real SmolLM2 through the official ``ollama`` library, on the local
model and on an upstream model (a second sluice in front of the first, slot ``up``,
translated from OpenAI chat)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import ollama
import pytest

from tests.support.real_server import wait_idle
from tests.support.servers import gateway_in_front

pytestmark = pytest.mark.integration

BACKENDS = ["smollm2", "up-smollm2"]
GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "Name three colors."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def gateway(base: str) -> Iterator[str]:
    with gateway_in_front(base) as url:
        yield url


@pytest.fixture
def client(base: str, gateway: str, request: pytest.FixtureRequest) -> ollama.Client:
    wait_idle(base, within=10)
    model = request.node.callspec.params["model"]
    return ollama.Client(host=base if model == "smollm2" else gateway, timeout=120)


@pytest.mark.parametrize("model", BACKENDS)
def test_chat_streamed_and_not(client: ollama.Client, model: str) -> None:
    whole = client.chat(model=model, messages=ASK, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count and whole.prompt_eval_count and whole.prompt_eval_count > 5
    assert whole.total_duration and whole.eval_duration is not None
    parts = list(client.chat(model=f"{model}:latest", messages=ASK, options=GREEDY, stream=True))
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    # Greedy: the stream says what the whole answer said.
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


@pytest.mark.parametrize("model", BACKENDS)
def test_generate_and_a_json_schema_format(client: ollama.Client, model: str) -> None:
    text = client.generate(model=model, prompt="Once upon a time", options=GREEDY)
    assert text.response and text.done
    person = client.chat(
        model=model,
        messages=[{"role": "user", "content": "Give a person as JSON."}],
        format=PERSON,
        options={"temperature": 0, "num_predict": 64},
    )
    value = json.loads(person.message.content)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


@pytest.mark.parametrize("model", BACKENDS)
def test_a_tool_result_in_the_history_is_answered(client: ollama.Client, model: str) -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C and sunny", "tool_name": "get_weather"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    answer = client.chat(model=model, messages=messages, tools=tools, options=GREEDY)
    assert answer.done and (answer.message.content or answer.message.tool_calls)


def test_discovery_on_the_local_server(base: str) -> None:
    wait_idle(base, within=10)
    c = ollama.Client(host=base, timeout=60)
    names = [m.model for m in c.list().models]
    assert "smollm2-135m-instruct" in names and "gemma-3-270m" in names
    smol = next(m for m in c.list().models if m.model == "smollm2-135m-instruct")
    assert smol.size and smol.size > 50_000_000 and smol.details is not None
    assert smol.details.quantization_level == "Q4_1" and smol.details.family == "llama"
    shown = c.show("smollm2")
    assert shown.capabilities is not None and {"completion", "tools"} <= set(shown.capabilities)
    assert shown.template and "<|im_start|>" in shown.template
    running = [m.model for m in c.ps().models]
    assert "smollm2-135m-instruct" in running


def test_discovery_through_a_gateway_lists_upstream_models(gateway: str) -> None:
    c = ollama.Client(host=gateway, timeout=60)
    assert "up-smollm2" in [m.model for m in c.list().models]
    assert "tools" in (c.show("up-smollm2").capabilities or [])
