"""Errors on the OpenAI routes: pre-stream statuses, in-band error frames, auth, limits.

The table every error comes from is tested in ``tests/core/test_errors.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.fakes import EOS, FAIL, ScriptedRunner
from tests.support.helpers import (
    CHAT,
    TEXT,
    chat_text,
    parse_sse,
    post_stream,
    prompt_for,
    scripted_server,
    user,
    wait_idle,
)

SSE = {"Accept": "text/event-stream"}


# -- a server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner() -> ScriptedRunner:
    return ScriptedRunner(n_ctx_seq=128)


@pytest.fixture(scope="module")
def base(runner: ScriptedRunner) -> Iterator[str]:
    with scripted_server(runner, parallel=2, queue=4) as url:
        yield url


def assert_error_json(
    r: httpx.Response, status: int, *, param: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def assert_one_error_frame(body: bytes) -> dict[str, Any]:
    frames = parse_sse(body)
    assert len(frames) == 1
    assert frames[0].event == "error"
    payload = frames[0].json()
    assert isinstance(payload["message"], str) and isinstance(payload["type"], str)
    assert payload["error"]["message"] == payload["message"]
    assert b"role" not in body and b"[DONE]" not in body
    return payload


# -- after the first byte: an in-band error frame -------------------------------------------


def test_mid_stream_failure_ends_with_error_frame(base: str, runner: ScriptedRunner) -> None:
    runner.scripts[prompt_for("fail mid")] = [b"partial", b" text", FAIL, b" never", EOS]
    res = post_stream(base, CHAT, {"messages": user("fail mid"), "stream": True})
    assert res.status == 200
    frames = parse_sse(res.body)
    assert frames[-1].event == "error"
    assert all(f.event is None for f in frames[:-1])
    payload = frames[-1].json()
    assert payload["type"] == "server_error" and "scripted decode failure" in payload["message"]
    assert payload["error"]["type"] == "server_error" and payload["error"]["message"]
    assert b"[DONE]" not in res.body
    assert res.body.endswith(b"\n\n")
    chunks = [f.json() for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chat_text(chunks).startswith("partial text")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # no fake normal end
    wait_idle(base)


def test_mid_stream_failure_text_completion(base: str, runner: ScriptedRunner) -> None:
    runner.scripts["text fail"] = [b"a", FAIL, b"b", b"c", EOS]
    res = post_stream(base, TEXT, {"prompt": "text fail", "stream": True})
    frames = parse_sse(res.body)
    assert res.status == 200 and frames[-1].event == "error"
    assert b"[DONE]" not in res.body


def test_mid_stream_failure_raises_in_openai_sdk(base: str, runner: ScriptedRunner) -> None:
    runner.scripts[prompt_for("fail sdk")] = [b"x", FAIL, b"y", EOS]
    client = OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=user("fail sdk"), stream=True)
    with pytest.raises(openai.APIError, match="scripted decode failure"):
        for _ in stream:
            pass


def test_nonstreaming_failure_is_500(base: str, runner: ScriptedRunner) -> None:
    runner.scripts[prompt_for("fail full")] = [b"x", FAIL, b"y", EOS]
    r = httpx.post(base + CHAT, json={"messages": user("fail full")}, timeout=10)
    err = assert_error_json(r, 500)
    assert err["type"] == "server_error" and "scripted decode failure" in err["message"]
    # The failed sequence's slot is free; the server still works.
    wait_idle(base)
    ok = httpx.post(base + CHAT, json={"messages": user("after failure")}, timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello world!"


# -- before the first byte: a real status ------------------------------------------------------


def test_invalid_json_is_400(base: str) -> None:
    r = httpx.post(
        base + CHAT, content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    err = assert_error_json(r, 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    r = httpx.post(base + CHAT, json=[1, 2])
    assert_error_json(r, 400)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": user("x"), "temperature": 5}, "temperature"),
        (CHAT, {"messages": user("x"), "n": 0}, "n"),
        (CHAT, {"messages": user("x"), "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": user("x"), "max_completion_tokens": -1}, "max_completion_tokens"),
        (CHAT, {"messages": user("x"), "top_p": 0}, "top_p"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": user("x"), "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"messages": user("x"), "top_logprobs": 3}, "top_logprobs"),
        (CHAT, {"messages": user("x"), "logit_bias": {"abc": 1}}, "logit_bias"),
        (TEXT, {"prompt": "x", "logprobs": 30}, "logprobs"),
        (TEXT, {"prompt": "x", "stop": ["1", "2", "3", "4", "5"]}, "stop"),
        (TEXT, {"prompt": []}, "prompt"),
        (TEXT, {"prompt": [1, "a"]}, "prompt"),
        (TEXT, {"prompt": [10**9]}, "prompt"),
        (TEXT, {"prompt": ""}, "prompt"),
    ],
)
def test_bad_values_are_400(base: str, path: str, body: dict[str, Any], param: str) -> None:
    for stream in (False, True):
        r = httpx.post(base + path, json={**body, "stream": stream})
        err = assert_error_json(r, 400)
        assert err["type"] == "invalid_request_error"
        # The field is named twice: in `param` (for programs) and in the message (for people).
        assert err["param"] == param, err
        assert param in err["message"], err
    wait_idle(base)


def test_four_stops_are_fine(base: str) -> None:
    r = httpx.post(base + CHAT, json={"messages": user("x"), "stop": ["1", "2", "3", "4"]})
    assert r.status_code == 200


def test_context_overflow_names_both_counts(base: str, runner: ScriptedRunner) -> None:
    r = httpx.post(base + TEXT, json={"prompt": "p" * 300})
    err = assert_error_json(r, 400, param="prompt")
    assert err["code"] == "context_length_exceeded"
    assert "300" in err["message"] and str(runner.n_ctx_seq) in err["message"]
    long_chat = "c" * 200
    n_prompt = len(prompt_for(long_chat))
    r = httpx.post(base + CHAT, json={"messages": user(long_chat), "stream": True})
    err = assert_error_json(r, 400)
    assert str(n_prompt) in err["message"] and str(runner.n_ctx_seq) in err["message"]
    # A prompt exactly the size of the context leaves no room for a token either.
    r = httpx.post(base + TEXT, json={"prompt": "p" * runner.n_ctx_seq})
    assert_error_json(r, 400, param="prompt")


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (TEXT, {"suffix": "tail"}, "suffix"),
    ],
)
def test_unsupported_fields_are_400_naming_the_field(
    base: str, path: str, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": user("x")} if path == CHAT else {"prompt": "x"}
    r = httpx.post(base + path, json={**body, **extra})
    err = assert_error_json(r, 400, param=param)
    assert param in err["message"]
    assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f"}},
                    {
                        "type": "function",
                        "function": {"name": "g", "parameters": {"type": "nonsense"}},
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
    ],
)
def test_bad_tools_and_formats_are_400_naming_the_field(
    base: str, extra: dict[str, Any], param: str
) -> None:
    r = httpx.post(base + CHAT, json={"messages": user("x"), **extra})
    assert_error_json(r, 400, param=param)


def test_unknown_fields_are_accepted(base: str) -> None:
    r = httpx.post(
        base + CHAT, json={"messages": user("x"), "frobnicate": True, "top_a": 0.3, "mirostat": 2}
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Hello world!"
    r = httpx.post(base + TEXT, json={"prompt": "x", "typical_p": 0.5})
    assert r.status_code == 200


def test_prestream_error_as_sse_frame_when_asked(base: str) -> None:
    cases = [
        (TEXT, {"prompt": "p" * 300}, 400, "context_length_exceeded"),
        (
            CHAT,
            {"messages": user("x"), "prediction": {"type": "content"}},
            400,
            "unsupported_parameter",
        ),
        (CHAT, {"messages": user("x"), "temperature": 9}, 400, None),
        (CHAT, {"messages": user("x"), "stop": list("abcde")}, 400, None),
    ]
    for path, body, status, code in cases:
        res = post_stream(base, path, {**body, "stream": True}, headers=SSE)
        assert res.status == status, res.body
        assert res.headers["content-type"].startswith("text/event-stream")
        payload = assert_one_error_frame(res.body)
        assert payload["type"] == "invalid_request_error"
        if code is not None:
            assert payload["code"] == code
        # Not streaming, or not asking for SSE: the plain JSON body.
        r = httpx.post(base + path, json={**body, "stream": False}, headers=SSE)
        assert_error_json(r, status)
        r = httpx.post(base + path, json={**body, "stream": True})
        assert_error_json(r, status)


def test_openai_sdk_gets_status_errors(base: str) -> None:
    client = OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=user("x"),
            stream=True,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert "tool_choice" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="m", prompt="p" * 500, stream=True)


def test_unknown_route_and_method(base: str) -> None:
    r = httpx.get(base + "/v1/nope")
    assert_error_json(r, 404)
    r = httpx.get(base + CHAT)
    assert_error_json(r, 405)
    r = httpx.get(base + "/v1/models/other-model")
    assert_error_json(r, 404, param="model")
    r = httpx.get(base + "/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted"


# -- no chat template -------------------------------------------------------------------------


def test_chat_without_template_is_400_but_text_works() -> None:
    runner = ScriptedRunner(chat_template=None)
    with scripted_server(runner) as base:
        for stream in (False, True):
            r = httpx.post(base + CHAT, json={"messages": user("hi"), "stream": stream})
            err = assert_error_json(r, 400)
            assert err["code"] == "missing_chat_template"
            assert "chat template" in err["message"]
        res = post_stream(base, CHAT, {"messages": user("hi"), "stream": True}, headers=SSE)
        assert res.status == 400
        assert assert_one_error_frame(res.body)["code"] == "missing_chat_template"
        r = httpx.post(base + TEXT, json={"prompt": "hi"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello world!"


# -- auth and body size ---------------------------------------------------------------------


def test_bearer_auth_and_body_limit() -> None:
    runner = ScriptedRunner()
    with scripted_server(runner, api_key="sekret", max_body_bytes=2048) as base:
        body = {"messages": user("hi")}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "sekret"},
            {"Authorization": "Basic sekret"},
        ):
            r = httpx.post(base + CHAT, json=body, headers=headers)
            err = assert_error_json(r, 401)
            assert err["type"] == "authentication_error"
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401
        good = {"Authorization": "Bearer sekret"}
        r = httpx.post(base + CHAT, json=body, headers=good)
        assert r.status_code == 200
        assert httpx.get(base + "/v1/models", headers=good).status_code == 200
        assert httpx.get(base + "/health").status_code == 200
        client = OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model="m", messages=user("hi"))
        client = OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0)
        assert (
            client.chat.completions.create(model="m", messages=user("hi"))
            .choices[0]
            .message.content
            == "Hello world!"
        )

        # Over the body limit: 413, with a declared length and with a chunked body.
        big = {"messages": user("x" * 4000)}
        r = httpx.post(base + CHAT, json=big, headers=good)
        err = assert_error_json(r, 413)
        assert "2048" in err["message"]

        def chunked() -> Iterator[bytes]:
            raw = json.dumps(big).encode()
            for i in range(0, len(raw), 500):
                yield raw[i : i + 500]

        r = httpx.post(
            base + CHAT, content=chunked(), headers={**good, "content-type": "application/json"}
        )
        assert_error_json(r, 413)
        assert httpx.post(base + CHAT, json=body, headers=good).status_code == 200
