"""/v1/messages and count_tokens on the real app around a scripted runner: the
boundaries a real model cannot be made to hit on cue (a decode failure mid-stream, the
context ending before max_tokens, a silence long enough for pings) and every error
before the stream, in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.fakes import EOS, FAIL, ScriptedRunner, chat_prompt
from tests.support.helpers import scripted_server

MESSAGES = "/v1/messages"


def body(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def events(raw: bytes) -> list[tuple[str, Any]]:
    """(event name, parsed data) of every frame; comments are an error here."""
    out = []
    assert raw.endswith(b"\n\n")
    for frame in raw.split(b"\n\n")[:-1]:
        lines = frame.split(b"\n")
        assert lines[0].startswith(b"event: "), f"not a named event: {frame!r}"
        assert lines[1].startswith(b"data: ") and len(lines) == 2, frame
        name = lines[0][7:].decode()
        data = json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


def test_a_decode_failure_mid_stream_is_an_anthropic_error_event() -> None:
    runner = ScriptedRunner(scripts={chat_prompt(("user", "Hi")): [b"Hel", FAIL, b"lo"]})
    with scripted_server(runner) as base:
        r = httpx.post(base + MESSAGES, json=body(stream=True), timeout=30)
    assert r.status_code == 200
    got = events(r.content)
    names = [name for name, _ in got]
    assert names[0] == "message_start" and names[-1] == "error"
    assert "message_stop" not in names
    error = got[-1][1]
    assert error["error"]["type"] == "api_error" and error["error"]["message"]


def test_the_context_ending_first_is_model_context_window_exceeded() -> None:
    runner = ScriptedRunner(n_ctx_seq=64, default=[b"x"] * 200)
    with scripted_server(runner) as base:
        r = httpx.post(base + MESSAGES, json=body(max_tokens=1000), timeout=30)
        streamed = httpx.post(base + MESSAGES, json=body(max_tokens=1000, stream=True), timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["stop_reason"] == "model_context_window_exceeded"
    assert 0 < message["usage"]["output_tokens"] < 1000
    delta = next(d for name, d in events(streamed.content) if name == "message_delta")
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"


def test_max_tokens_and_stop_sequences() -> None:
    runner = ScriptedRunner(default=[b"one", b" two", b" three", b" four", EOS])
    with scripted_server(runner) as base:
        short = httpx.post(base + MESSAGES, json=body(max_tokens=2), timeout=30).json()
        stopped = httpx.post(
            base + MESSAGES, json=body(stop_sequences=["nope", "thr"]), timeout=30
        ).json()
        whole = httpx.post(base + MESSAGES, json=body(), timeout=30).json()
    assert (short["stop_reason"], short["usage"]["output_tokens"]) == ("max_tokens", 2)
    assert short["content"] == [{"type": "text", "text": "one two"}]
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "thr")
    assert stopped["content"][0]["text"] == "one two "
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("end_turn", None)


def test_a_quiet_stream_is_kept_alive_with_ping_events() -> None:
    runner = ScriptedRunner(default=[b"a", b"b", b"c", EOS], step_delay=0.25)
    with scripted_server(runner, ping_interval=0.1) as base:
        r = httpx.post(base + MESSAGES, json=body(stream=True), timeout=30)
    got = events(r.content)  # no ": ping" comment: every frame is a named event
    pings = [data for name, data in got if name == "ping"]
    assert pings and all(p == {"type": "ping"} for p in pings)
    assert got[-1][0] == "message_stop"


def test_a_prompt_over_the_context_is_a_400_before_the_stream() -> None:
    with scripted_server(ScriptedRunner(n_ctx_seq=64)) as base:
        r = httpx.post(base + MESSAGES, json=body("x" * 200, stream=True), timeout=30)
        counted = httpx.post(base + MESSAGES + "/count_tokens", json=body("x" * 200), timeout=30)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("prompt is too long: ")
    # Counting still answers: the client learns by how much it is over.
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 64


def test_count_tokens_is_the_templated_prompt() -> None:
    with scripted_server(ScriptedRunner()) as base:
        r = httpx.post(
            base + MESSAGES + "/count_tokens",
            json={"model": "scripted", "system": "Be brief.", "messages": body()["messages"]},
            timeout=30,
        )
    # The scripted tokenizer is one token per character of the rendered template.
    prompt = chat_prompt(("system", "Be brief."), ("user", "Hi"))
    assert r.status_code == 200 and r.json() == {"input_tokens": len(prompt)}


@pytest.mark.parametrize(
    ("method", "path", "data", "status", "kind"),
    [
        ("POST", MESSAGES, {"model": "scripted", "messages": []}, 400, "invalid_request_error"),
        ("POST", MESSAGES, "not json", 400, "invalid_request_error"),
        ("GET", MESSAGES, None, 405, "invalid_request_error"),
        ("POST", MESSAGES + "/batches", {}, 404, "not_found_error"),
        ("POST", MESSAGES + "/count_tokens", {"model": "scripted"}, 400, "invalid_request_error"),
    ],
)
def test_errors_come_in_anthropic_shape(
    method: str, path: str, data: Any, status: int, kind: str
) -> None:
    with scripted_server(ScriptedRunner()) as base:
        content = data if isinstance(data, str) else json.dumps(data) if data else None
        r = httpx.request(method, base + path, content=content, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == kind and error["error"]["message"]


def test_an_image_for_a_local_model_is_a_400_that_says_so() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/cat.png"}}
    content = [{"type": "text", "text": "What is this?"}, image]
    data = {
        "model": "scripted",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
    }
    with scripted_server(ScriptedRunner()) as base:
        r = httpx.post(base + MESSAGES, json=data, timeout=30)
        counted = httpx.post(base + MESSAGES + "/count_tokens", json=data, timeout=30)
    for answer in (r, counted):
        assert answer.status_code == 400
        assert "has no vision projector" in answer.json()["error"]["message"]


def test_beta_headers_versions_and_the_beta_query_are_accepted() -> None:
    headers = {
        "anthropic-version": "2099-01-01",
        "anthropic-beta": "claude-code-20250219,made-up-feature-2099-12-31",
    }
    with scripted_server(ScriptedRunner()) as base:
        r = httpx.post(base + MESSAGES + "?beta=true", json=body(), headers=headers, timeout=30)
        c = httpx.post(
            base + MESSAGES + "/count_tokens?beta=true", json=body(), headers=headers, timeout=30
        )
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello world!"
    assert c.status_code == 200 and c.json()["input_tokens"] > 0
