"""Anthropic's Messages API on the real SmolLM2, through the official ``anthropic`` SDK,
on every backend: the local model (the session's server), an upstream translated from
OpenAI chat (a second sluice in front of the first, slot ``up``), and an upstream that
speaks Messages itself (slot ``native``, whose bytes pass through unchanged, recorded
by a relay and compared)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.real_server import wait_idle
from tests.support.relay import Relay
from tests.support.servers import gateway_in_front

pytestmark = pytest.mark.integration

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def gateway(relay: Relay) -> Iterator[str]:
    """A sluice whose only models are the session server's, through two slots."""
    with gateway_in_front(relay.url, native_apis=("anthropic",)) as url:
        yield url


# The same tests on each backend: the model name picks it.
BACKENDS = ["smollm2", "up-smollm2", "native-smollm2"]


@pytest.fixture
def client(
    base: str, gateway: str, request: pytest.FixtureRequest
) -> Iterator[anthropic.Anthropic]:
    wait_idle(base, within=10)
    model = request.node.callspec.params["model"]
    url = base if model == "smollm2" else gateway
    with anthropic.Anthropic(base_url=url, api_key="not-needed", max_retries=0, timeout=120) as c:
        yield c


def total_input(usage: Any) -> int:
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


@pytest.mark.parametrize("model", BACKENDS)
def test_create(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(
        model=model, max_tokens=24, messages=ASK, extra_body={"temperature": 0}
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert 0 < message.usage.output_tokens <= 24
    counted = client.messages.count_tokens(model=model, messages=ASK)
    assert counted.input_tokens == total_input(message.usage) > 5


@pytest.mark.parametrize("model", BACKENDS)
def test_stream_text_and_final_message(client: anthropic.Anthropic, model: str) -> None:
    with client.messages.stream(
        model=model,
        max_tokens=24,
        system=[{"type": "text", "text": "You are terse."}],
        messages=ASK,
        extra_body={"temperature": 0},
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1  # it streamed, token by token
    assert "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0 and total_input(final.usage) > 5


@pytest.mark.parametrize("model", BACKENDS)
def test_a_tool_use_round_trip(client: anthropic.Anthropic, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(
        model=model,
        max_tokens=48,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask,  # type: ignore[arg-type]
    ) as stream:
        partials = [e.partial_json for e in stream if e.type == "input_json"]
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    assert len(partials) > 1  # the input streamed in fragments, not as one lump
    assert json.loads("".join(partials)) == call.input
    # The result goes back; the model answers in text.
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C, sunny"}],
        },
    ]
    second = client.messages.create(
        model=model,
        max_tokens=24,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=history,
        extra_body={"temperature": 0},  # greedy: at 1, an empty answer now and then
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content[0].type == "text" and second.content[0].text
    # The tools and the history are part of the counted prompt.
    counted = client.messages.count_tokens(model=model, messages=history, tools=[WEATHER])
    bare = client.messages.count_tokens(model=model, messages=history)
    assert counted.input_tokens > bare.input_tokens


def test_stop_sequences_and_max_tokens(base: str) -> None:
    wait_idle(base, within=10)
    with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120) as c:
        free = c.messages.create(
            model="smollm2", max_tokens=30, messages=ASK, extra_body={"temperature": 0}
        )
        text = free.content[0].text  # type: ignore[union-attr]
        stop = text.strip()[4:7]  # a few characters from inside the greedy answer
        assert len(stop) == 3
        stopped = c.messages.create(
            model="smollm2",
            max_tokens=30,
            messages=ASK,
            extra_body={"temperature": 0},
            stop_sequences=[stop],
        )
        short = c.messages.create(
            model="smollm2", max_tokens=3, messages=ASK, extra_body={"temperature": 0}
        )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 3)


def test_the_event_order_on_the_wire(base: str) -> None:
    wait_idle(base, within=10)
    data = {
        "model": "smollm2",
        "max_tokens": 40,
        "stream": True,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Weather in Rome and Oslo?"}],
    }
    r = httpx.post(f"{base}/v1/messages", json=data, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [f.split("\n") for f in r.text.split("\n\n") if f]
    names = [f[0].removeprefix("event: ") for f in frames]
    payloads = [json.loads(f[1].removeprefix("data: ")) for f in frames]
    assert [p["type"] for p in payloads] == names
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    opened: int | None = None
    seen = 0
    for name, p in zip(names[1:-2], payloads[1:-2], strict=True):
        if name == "content_block_start":
            assert opened is None and p["index"] == seen
            opened, seen = p["index"], seen + 1
        elif name == "content_block_delta":
            assert p["index"] == opened
        elif name == "content_block_stop":
            assert p["index"] == opened
            opened = None
        else:
            assert name == "ping"
    assert opened is None and seen >= 1
    assert payloads[-2]["delta"]["stop_reason"] == "tool_use"


def test_native_passthrough_is_byte_for_byte(base: str, gateway: str, relay: Relay) -> None:
    wait_idle(base, within=10)
    data = {"model": "native-smollm2", "max_tokens": 12, "messages": ASK, "temperature": 0}
    for stream in (False, True):
        r = httpx.post(f"{gateway}/v1/messages", json=data | {"stream": stream}, timeout=60)
        assert r.status_code == 200
        assert r.headers["x-sluice-slot"] == f"native; replica={relay.url}"
        assert relay.sent(r.content), "the gateway's body is not what the upstream sent"
    # A translated slot's answer is sluice's own, decoded and re-encoded.
    up = httpx.post(f"{gateway}/v1/messages", json=data | {"model": "up-smollm2"}, timeout=60)
    assert up.headers["x-sluice-slot"] == f"up; replica={relay.url}"
    assert up.json()["model"] == "up-smollm2"


def test_upstream_errors_keep_anthropic_shape(base: str, gateway: str) -> None:
    wait_idle(base, within=10)
    bad = {
        "model": "up-smollm2",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "document"}]}],
    }
    r = httpx.post(f"{gateway}/v1/messages", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "'document'" in r.json()["error"]["message"]
    with anthropic.Anthropic(base_url=gateway, api_key="x", max_retries=0, timeout=60) as c:
        for model in ("up-smollm2", "native-smollm2"):
            with pytest.raises(anthropic.BadRequestError) as info:
                c.messages.create(model=model, max_tokens=8, messages=[])
            assert info.value.status_code == 400
