"""The router with real processes: a second sluice in front of the session's server.

The gateway (a ``sluice serve --config``) fronts the session's SmolLM2 server
as the upstream slot ``up`` through a TCP relay that records every byte the
upstream sends back, so passthrough is checked byte for byte against what
the upstream really said, streaming and not, tools included.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from sluice.core.fold import Fold
from sluice.dialects.openai.format import ResponseMeta, chat_completion_body
from sluice.dialects.openai.schema import ChatCompletionRequest
from sluice.metrics import Metrics
from sluice.upstream.backend import UpstreamSlot
from sluice.upstream.config import UpstreamSpec
from sluice.upstream.pool import UpstreamPool
from tests.support.real_server import QUIET, parse_sse, wait_idle
from tests.support.relay import Relay
from tests.support.servers import serve_process
from tests.support.tools import WEATHER

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(relay: Relay) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sluice.toml"
        config.write_text(
            "[[upstreams]]\n"
            'name = "up"\n'
            f'url = "{relay.url}/v1"\n'
            'aliases = { "up-smollm2" = "smollm2" }\n'
            "timeout = 60\n"
        )
        with serve_process("--config", str(config), *QUIET) as url:
            yield url


def _body(stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": "up-smollm2",
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 12,
        "temperature": 0,
        "seed": 7,
        "stream": stream,
        **extra,
    }


def _recorded(relay: Relay, body: bytes) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if body in relay.bodies():
            return True
        time.sleep(0.05)
    return False


def _normalized(body: bytes) -> bytes:
    """Without what differs between two answers by design: the response id and time,
    and how much of the prompt the second found in the cache."""
    body = re.sub(rb'"cached_tokens":\d+', b'"cached_tokens":0', body)
    body = re.sub(rb'"id":"[^"]+"', b'"id":"X"', body)
    return re.sub(rb'"created":\d+', b'"created":0', body)


@pytest.mark.parametrize("stream", [True, False])
def test_passthrough_is_byte_for_byte(base: str, gateway: str, relay: Relay, stream: bool) -> None:
    wait_idle(base, within=10)
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    r = httpx.post(f"{gateway}/v1/chat/completions", json=_body(stream, **extra), timeout=60)
    assert r.status_code == 200
    assert r.headers["x-sluice-slot"] == f"up; replica={relay.url}"
    assert _recorded(relay, r.content), "the gateway's body is not what the upstream sent"
    # And the same as asking the upstream directly, but for the per-response id and time.
    direct_body = _body(stream, **extra) | {"model": "smollm2"}
    direct = httpx.post(f"{base}/v1/chat/completions", json=direct_body, timeout=60)
    assert _normalized(r.content) == _normalized(direct.content)


def test_passthrough_streams_tool_calls_unchanged(base: str, gateway: str, relay: Relay) -> None:
    wait_idle(base, within=10)
    body = _body(
        True,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
    )
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert _recorded(relay, r.content)
    chunks = [e.json() for e in parse_sse(r.content) if e.data != "[DONE]"]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_official_sdk_through_the_gateway(gateway: str) -> None:
    client = OpenAI(base_url=f"{gateway}/v1", api_key="none")
    raw = client.chat.completions.with_raw_response.create(**_body(False))
    assert raw.headers["x-sluice-slot"].startswith("up; replica=")
    completion = raw.parse()
    # The upstream's own answer: it names its model by its full name, not the alias.
    assert completion.model == "smollm2-135m-instruct"
    assert completion.choices[0].message.content
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**_body(True))
        if c.choices
    )
    assert text == completion.choices[0].message.content


def test_local_models_still_answer_with_their_slot_named(gateway: str) -> None:
    r = httpx.post(f"{gateway}/v1/chat/completions", json=_body(False, model="smollm2"))
    assert r.status_code == 200
    assert r.headers["x-sluice-slot"] == "smollm2-135m-instruct"


def test_models_and_info_list_every_slot(gateway: str, relay: Relay) -> None:
    models = httpx.get(f"{gateway}/v1/models").json()["data"]
    by_id = {m["id"]: m for m in models}
    # The upstream's smollm2 is shadowed by the gateway's own: listed under its alias.
    assert by_id["smollm2-135m-instruct"]["owned_by"] == "sluice"
    assert by_id["up-smollm2"]["owned_by"] == "up"
    assert httpx.get(f"{gateway}/v1/models/up-smollm2").json()["owned_by"] == "up"

    info = httpx.get(f"{gateway}/v1/info").json()
    entries = {m["id"]: m for m in info["models"]}
    up = entries["up-smollm2"]
    assert up["backend"]["type"] == "upstream" and up["backend"]["slot"] == "up"
    assert up["backend"]["replicas"][0]["url"] == relay.url
    assert up["status"] == "healthy"
    assert up["context_window"] == 2048  # the upstream's --ctx, from its /v1/models meta
    local = entries["smollm2-135m-instruct"]
    assert local["backend"]["type"] == "local"
    assert local["family"] == "llama"
    assert local["capabilities"]["tools"] is True
    assert local["capabilities"]["trained_for_tool_use"] is False  # SmolLM2's template


def _metric(gateway: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway}/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_metrics_count_what_was_streamed(base: str, gateway: str) -> None:
    wait_idle(base, within=10)
    before_out = _metric(gateway, "sluice_tokens_total", slot="up", direction="out")
    before_ttft = _metric(gateway, "sluice_time_to_first_token_seconds_count", slot="up")
    body = _body(True, stream_options={"include_usage": True}, max_tokens=9)
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    usage = [e.json() for e in parse_sse(r.content) if e.data != "[DONE]"][-1]["usage"]
    after_out = _metric(gateway, "sluice_tokens_total", slot="up", direction="out")
    assert after_out - before_out == usage["completion_tokens"]
    assert _metric(gateway, "sluice_time_to_first_token_seconds_count", slot="up") == (
        before_ttft + 1
    )
    slot = httpx.get(f"{gateway}/v1/info").json()["slots"]["up"]
    assert slot["in_flight"] == 0 and slot["tokens_out"] >= usage["completion_tokens"]


def test_client_disconnect_closes_the_upstream_request(base: str, gateway: str) -> None:
    wait_idle(base, within=10)
    body = _body(True, max_tokens=400, ignore_eos=True)
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=60) as r:
        for _ in r.iter_raw():
            break  # the first bytes: the upstream is generating
    # The upstream's slot is free again well before 400 tokens could have been made.
    assert wait_idle(base, within=3.0) < 3.0


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 40,
        },
    ],
    ids=["text", "tool_call"],
)
async def test_open_decodes_an_upstream_into_the_answer_it_gives_directly(
    base: str, extra: dict[str, Any]
) -> None:
    """The backend protocol on an upstream model (what LM Studio's chat and /c1 will
    use): its SSE decoded into events and folded equals its own non-streaming answer."""
    wait_idle(base, within=10)
    body = _body(False, **extra) | {"model": "smollm2"}
    spec = UpstreamSpec(name="up", urls=(base,))
    pool = UpstreamPool(spec)
    await pool.start()
    try:
        slot = UpstreamSlot(spec, pool, Metrics().slot("up", "upstream"))
        stream = await slot.model("smollm2").open(
            ChatCompletionRequest.model_validate(body).to_request()
        )
        try:
            fold = Fold(stream.meta.prompt_owners)
            async for event in stream:
                fold.add(event)
        finally:
            await stream.aclose()
        assert stream.meta.slot == "up" and stream.meta.replica == base
        ours = chat_completion_body(ResponseMeta.of(stream.meta, chat=True), fold.result())
    finally:
        await pool.close()
    async with httpx.AsyncClient() as client:
        direct = (await client.post(f"{base}/v1/chat/completions", json=body, timeout=60)).json()
    # What differs by design: the response's id and time, the tool calls' ids, how much
    # of the prompt the second request found cached, and the model's name (ours is the
    # name asked for, where the upstream answers with its full name for it).
    for answer in (ours, direct):
        for key in ("id", "created", "system_fingerprint", "model"):
            answer.pop(key, None)
        answer["usage"]["prompt_tokens_details"]["cached_tokens"] = 0
        for call in answer["choices"][0]["message"].get("tool_calls") or []:
            call["id"] = "call"
    assert ours == direct
