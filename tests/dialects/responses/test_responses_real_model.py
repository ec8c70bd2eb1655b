"""OpenAI's Responses API on the real SmolLM2 through the official ``openai`` SDK, on the
local model and on upstream models: a second sluice in front of the first, through a
recording relay, with slot ``up`` (translated from OpenAI chat) and slot ``native``
(``native_apis = ["responses"]``: the body goes up as written and the bytes come back
unchanged; the upstream stores the responses)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.support.real_server import wait_idle
from tests.support.relay import Relay
from tests.support.servers import gateway_in_front

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
BACKENDS = ["smollm2", "up-smollm2"]


@pytest.fixture(scope="module")
def gateway(relay: Relay) -> Iterator[str]:
    with gateway_in_front(relay.url, native_apis=("responses",)) as url:
        yield url


@pytest.fixture
def client(base: str, gateway: str, request: pytest.FixtureRequest) -> Iterator[OpenAI]:
    wait_idle(base, within=10)
    model = request.node.callspec.params["model"]
    url = base if model == "smollm2" else gateway
    with OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("model", BACKENDS)
def test_create_stream_retrieve_and_continue(client: OpenAI, model: str) -> None:
    plain = client.responses.create(
        model=model, input="Name a color.", max_output_tokens=24, temperature=0
    )
    assert plain.id.startswith("resp_") and plain.status in ("completed", "incomplete")
    assert plain.output_text and plain.usage is not None and plain.usage.input_tokens > 5
    with client.responses.stream(
        model=model,
        input="Name three colors.",
        instructions="Be brief.",
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text
    follow = client.responses.create(
        model=model, input="And one more?", previous_response_id=final.id, max_output_tokens=16
    )
    # The history came along: the prompt is longer than the new input alone.
    assert follow.usage is not None and final.usage is not None
    assert follow.usage.input_tokens > final.usage.input_tokens


@pytest.mark.parametrize("model", BACKENDS)
def test_a_function_call_round_trip(client: OpenAI, model: str) -> None:
    first = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER, {"type": "web_search"}],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=48,
    )
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=24,
    )
    assert second.output_text


def test_background_and_resume(base: str) -> None:
    wait_idle(base, within=10)
    with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120) as c:
        started = c.responses.create(
            model="smollm2", input="Tell a story.", background=True, max_output_tokens=48
        )
        assert started.status == "queued"
        with c.responses.stream(response_id=started.id, starting_after=1) as stream:
            events = list(stream)
        assert events[0].sequence_number == 2
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert c.responses.retrieve(started.id).status == events[-1].response.status  # type: ignore[union-attr]


def test_native_responses_pass_through_byte_for_byte(base: str, gateway: str, relay: Relay) -> None:
    wait_idle(base, within=10)
    data = {"model": "native-smollm2", "input": "Name a color.", "max_output_tokens": 12}
    for stream in (False, True):
        r = httpx.post(f"{gateway}/v1/responses", json=data | {"stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-sluice-slot"] == f"native; replica={relay.url}"
        assert relay.sent(r.content), "the gateway's body is not what the upstream sent"
    with OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=120) as c:
        # The SDK's stream and final response, and a continuation: the upstream
        # stored the first response and takes previous_response_id as it came.
        with c.responses.stream(
            model="native-smollm2",
            input="Name three colors.",
            instructions="Be brief.",
            max_output_tokens=200,
            temperature=0,
        ) as s:
            deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
            final = s.get_final_response()
        assert deltas and "".join(deltas) == final.output_text
        follow = c.responses.create(
            model="native-smollm2",
            input="And one more?",
            previous_response_id=final.id,
            max_output_tokens=8,
        )
        assert follow.usage is not None and final.usage is not None
        assert follow.usage.input_tokens > final.usage.input_tokens
    # Stored on the upstream, not on the gateway.
    with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as up:
        assert up.responses.retrieve(final.id).output_text == final.output_text
    assert httpx.get(f"{gateway}/v1/responses/{final.id}", timeout=10).status_code == 404
