"""Errors knowable before the first byte are real 4xx answers, on the real model."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.real_server import parse_sse, wait_idle

pytestmark = pytest.mark.integration

OVERFLOW_RE = re.compile(r"maximum context length is (\d+) tokens, but the prompt is (\d+) tokens")
# ~300 tokens of chat: over the small server's 256, well under the main server's 2048
LONG_USER = "Please summarise the following notes. " + "The cat sat on the mat. " * 45


@pytest.fixture
def small(small_base: str) -> str:
    """The --ctx 256 server (one slot), idle."""
    wait_idle(small_base, within=10)
    return small_base


def _prompt_tokens(base: str, path: str, body: dict) -> int:
    """The prompt's token count as the big server reports it (same model, same tokenizer)."""
    r = httpx.post(f"{base}{path}", json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def _check_overflow_body(r: httpx.Response, n_prompt: int, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == param
    m = OVERFLOW_RE.search(err["message"])
    assert m, err["message"]
    assert (int(m.group(1)), int(m.group(2))) == (256, n_prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_over_context_is_400_with_both_counts(base: str, small: str, stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": LONG_USER}]}
    n_prompt = _prompt_tokens(base, "/v1/chat/completions", body)
    assert 256 < n_prompt < 2048
    r = httpx.post(f"{small}/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
    _check_overflow_body(r, n_prompt, "messages")


@pytest.mark.parametrize("stream", [False, True])
def test_text_over_context_is_400_with_both_counts(base: str, small: str, stream: bool) -> None:
    body = {"prompt": LONG_USER}
    n_prompt = _prompt_tokens(base, "/v1/completions", body)
    assert 256 < n_prompt < 2048
    r = httpx.post(f"{small}/v1/completions", json={**body, "stream": stream}, timeout=60)
    _check_overflow_body(r, n_prompt, "prompt")


def test_token_id_prompt_over_context_exact_count(small: str) -> None:
    r = httpx.post(f"{small}/v1/completions", json={"prompt": [42] * 300}, timeout=60)
    _check_overflow_body(r, 300, "prompt")


def test_overflow_as_sse_error_frame_when_asked(small: str) -> None:
    """Accept: text/event-stream on a streaming call: one `event: error` frame, no role frame."""
    r = httpx.post(
        f"{small}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": LONG_USER}], "stream": True},
        headers={"accept": "text/event-stream"},
        timeout=60,
    )
    assert r.status_code == 400
    events = parse_sse(r.content)
    assert len(events) == 1 and events[0].event == "error"
    payload = events[0].json()
    assert OVERFLOW_RE.search(payload["message"])
    assert payload["type"] == "invalid_request_error"
    assert payload["error"]["code"] == "context_length_exceeded"
    assert b"assistant" not in r.content and b"[DONE]" not in r.content


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_raises_bad_request_on_overflow(small: str, stream: bool) -> None:
    with OpenAI(base_url=f"{small}/v1", api_key="not-needed", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as chat_err:
            c.chat.completions.create(
                model="local-model",
                messages=[{"role": "user", "content": LONG_USER}],
                stream=stream,
            )
        with pytest.raises(openai.BadRequestError) as text_err:
            c.completions.create(model="local-model", prompt=LONG_USER, stream=stream)
    for exc in (chat_err.value, text_err.value):
        assert exc.status_code == 400
        assert exc.code == "context_length_exceeded"
        assert OVERFLOW_RE.search(exc.message), exc.message


def test_generation_stops_at_end_of_context(small: str) -> None:
    """A prompt that fits but leaves little room: 'length' at the context end, never past it."""
    r = httpx.post(
        f"{small}/v1/completions",
        json={"prompt": [42] * 250, "max_tokens": 100, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 250
    # the context holds 256 tokens: 250 + completion never exceeds it, and the end is reached
    assert 5 <= body["usage"]["completion_tokens"] <= 256 - 250
    # the slot is reusable afterwards
    r2 = httpx.post(f"{small}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 3


def test_unknown_route_is_404_json(base: str) -> None:
    r = httpx.get(f"{base}/v1/nope", timeout=10)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == "not_found" and "/v1/nope" in err["message"]
    assert err["type"] == "invalid_request_error"
    r = httpx.post(f"{base}/v2/chat/completions", json={}, timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_wrong_method_is_405_json(base: str) -> None:
    r = httpx.get(f"{base}/v1/chat/completions", timeout=10)
    assert r.status_code == 405
    assert "error" in r.json()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
    ],
)
def test_invalid_chat_request_is_400_naming_the_field(base: str, body: dict, param: str) -> None:
    for stream in (False, True):
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        assert param in err["message"]


def test_sdk_unknown_model_route_raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
