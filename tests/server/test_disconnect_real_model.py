"""A client that goes away frees its slot (streaming and not), and the server carries on."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.real_server import health, wait_idle
from tests.support.servers import serve_process_handle

pytestmark = pytest.mark.integration

LONG_TEXT = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
LONG_CHAT = {
    "messages": [{"role": "user", "content": "Tell me a very long story."}],
    "max_tokens": 1500,
    "ignore_eos": True,
}


def _wait_active(base: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while health(base)["slots"]["active"] < 1:
        assert time.monotonic() < deadline, "the request never became active"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", LONG_TEXT), ("/v1/chat/completions", LONG_CHAT)]
)
def test_stream_disconnect_frees_slot(base: str, path: str, body: dict) -> None:
    wait_idle(base)
    tokens_before = health(base)["engine"]["tokens_generated"]
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", f"{base}{path}", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        got = 0
        # Keep a reference: a dropped, half-read iter_lines() generator is finalized at once
        # and httpx then closes the connection, which would hang up before the check below.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                got += 1
            if got >= 4:
                break
        assert got == 4
        busy = health(base)["slots"]
        assert busy["active"] == 1, busy
    # the response and its client are closed here: the connection is gone
    took = wait_idle(base, within=2.5)
    assert took < 2.5
    # generation really stopped: far fewer than the 1500 tokens asked for were made
    time.sleep(0.3)
    made = health(base)["engine"]["tokens_generated"] - tokens_before
    assert made < 1000, made
    # and the server still answers normally
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_sdk_stream_close_frees_slot(base: str, client: OpenAI) -> None:
    body = {k: v for k, v in LONG_CHAT.items() if k != "ignore_eos"}
    stream = client.chat.completions.create(
        model="local-model", stream=True, **body, extra_body={"ignore_eos": True}
    )
    pieces = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
        if pieces >= 3:
            break
    assert health(base)["slots"]["active"] == 1
    stream.close()
    assert wait_idle(base, within=2.5) < 2.5


@pytest.mark.parametrize(
    "path,body", [("/v1/completions", LONG_TEXT), ("/v1/chat/completions", LONG_CHAT)]
)
def test_non_stream_client_timeout_frees_slot(base: str, path: str, body: dict) -> None:
    wait_idle(base)
    tokens_before = health(base)["engine"]["tokens_generated"]
    with pytest.raises(httpx.ReadTimeout):
        # 1500 tokens take far longer than this; the client gives up and hangs up
        httpx.post(f"{base}{path}", json=body, timeout=httpx.Timeout(30, read=1.5))
    # it was really generating when the client left (not rejected, not finished)
    made_while_waiting = health(base)["engine"]["tokens_generated"] - tokens_before
    assert made_while_waiting > 0
    assert wait_idle(base, within=2.5) < 2.5
    time.sleep(0.3)
    made = health(base)["engine"]["tokens_generated"] - tokens_before
    assert made < 1000, made


def test_sdk_non_stream_timeout_frees_slot(base: str) -> None:
    wait_idle(base)
    body = {k: v for k, v in LONG_TEXT.items() if k != "ignore_eos"}
    with (
        OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=1.5) as c,
        pytest.raises(openai.APITimeoutError),
    ):
        c.completions.create(model="local-model", **body, extra_body={"ignore_eos": True})
    assert wait_idle(base, within=2.5) < 2.5


def test_shutdown_without_grace_ends_streams_with_an_error_frame_at_once() -> None:
    """``--shutdown-grace 0``: SIGTERM mid-stream ends it with an `event: error` frame now.

    (With a grace, running streams may finish first: test_shutdown_real_model.py.)
    """
    args = ("--threads", "1", "--log-level", "warning", "--shutdown-grace", "0")
    with serve_process_handle(*args) as (url, proc):
        body = {
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        received = b""
        signalled = 0.0
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                received += chunk
                if not signalled and received.count(b"data: ") >= 5:
                    proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
        ended = time.monotonic() - signalled
        # uvicorn shuts down, then re-raises the signal it caught (-SIGTERM).
        assert proc.wait(30) in (0, -signal.SIGTERM)
        exited = time.monotonic() - signalled
    assert signalled
    tail = received.rstrip().rsplit(b"\n\n", 1)[-1]
    assert tail.startswith(b"event: error\ndata: "), tail
    payload = json.loads(tail.split(b"data: ", 1)[1])
    assert payload["code"] == "shutting_down" and payload["error"]["type"] == "server_error"
    assert b"data: [DONE]" not in received
    assert ended < 1.5, ended  # at once, not after a grace
    assert exited < 5, exited
