"""The packaged gemma3-270m base model: text completions work; chat has no template -> 400,
and with a template given, tools and JSON schemas on its 262k vocabulary.

The first start may assemble the GGUF from its chunk packages into ~/.cache;
``serve_process`` allows two minutes for the server to become healthy.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.real_server import QUIET, data_chunks, parse_sse
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gemma() -> Iterator[str]:
    with serve_process("--model", "gemma3-270m", "--parallel", "2", "--ctx", "512", *QUIET) as url:
        yield url


def test_gemma_is_the_served_model(gemma: str) -> None:
    data = httpx.get(f"{gemma}/v1/models", timeout=10).json()["data"]
    # The default model is listed first, loaded; the embedded one is known, not loaded.
    assert [(m["id"], m["status"]) for m in data] == [
        ("gemma-3-270m", "loaded"),
        ("smollm2-135m-instruct", "not_loaded"),
    ]
    assert data[0]["meta"]["chat_template"] is False
    assert httpx.get(f"{gemma}/health", timeout=10).json()["model"] == "gemma-3-270m"


def test_gemma_text_completion(gemma: str) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{gemma}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "gemma-3-270m"
    text = out["choices"][0]["text"]
    assert text.strip() and "\ufffd" not in text
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= out["usage"]["completion_tokens"] <= 8

    # streamed: the same greedy text, in the same frame contract
    r = httpx.post(f"{gemma}/v1/completions", json={**body, "stream": True}, timeout=120)
    chunks = data_chunks(parse_sse(r.content))
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_gemma_text_completion_via_sdk(gemma: str) -> None:
    with OpenAI(base_url=f"{gemma}/v1", api_key="not-needed", max_retries=0) as c:
        r = c.completions.create(
            model="gemma3-270m", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0
        )
    assert r.choices[0].text.strip()
    assert r.usage is not None and r.usage.completion_tokens <= 6


@pytest.mark.parametrize("stream", [False, True])
def test_gemma_chat_is_400_naming_missing_template(gemma: str, stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{gemma}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "missing_chat_template"
    assert err["type"] == "invalid_request_error"
    assert "chat template" in err["message"] and "gemma-3-270m" in err["message"]
    assert "/v1/completions" in err["message"]  # it says what to use instead


def test_gemma_chat_sse_error_frame_without_role(gemma: str) -> None:
    r = httpx.post(
        f"{gemma}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello!"}], "stream": True},
        headers={"accept": "text/event-stream"},
        timeout=30,
    )
    assert r.status_code == 400
    events = parse_sse(r.content)
    assert [e.event for e in events] == ["error"]
    assert "chat template" in events[0].json()["message"]
    assert b'"role"' not in r.content


@pytest.mark.parametrize("stream", [False, True])
def test_gemma_chat_sdk_raises_bad_request(gemma: str, stream: bool) -> None:
    with (
        OpenAI(base_url=f"{gemma}/v1", api_key="not-needed", max_retries=0) as c,
        pytest.raises(openai.BadRequestError) as err,
    ):
        c.chat.completions.create(
            model="local-model", messages=[{"role": "user", "content": "Hello!"}], stream=stream
        )
    assert err.value.code == "missing_chat_template"
    assert "chat template" in err.value.message


def test_gemma_with_a_template_calls_a_tool_and_answers_json(tmp_path: Path) -> None:
    """Gemma 3's 262k vocabulary under the grammar gate (llguidance's tokenizer for it),
    with a template that has no system role (the tool prompt goes into the user turn)."""
    from tests.local.test_templates import GEMMA

    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA)
    args = ("--model", "gemma3-270m", "--chat-template", str(template), "--parallel", "1")
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    }
    with (
        serve_process(*args, "--ctx", "1024", *QUIET) as url,
        OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        asked = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Oslo?"}]
        r = client.chat.completions.create(
            model="gemma3-270m",
            messages=asked,
            tools=[weather],
            tool_choice="required",
            max_tokens=64,
            temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)
        n = {"type": "integer", "minimum": 0, "maximum": 999}
        schema = {"type": "object", "properties": {"n": n}, "required": ["n"]}
        r = client.chat.completions.create(
            model="gemma3-270m",
            messages=[{"role": "user", "content": "A number as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            max_tokens=32,
            temperature=0,
        )
        assert 0 <= json.loads(r.choices[0].message.content or "")["n"] <= 999
