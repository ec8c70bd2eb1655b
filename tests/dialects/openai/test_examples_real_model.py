"""The documented examples of the stream contract (curl, the OpenAI SDK), run as written
against the real server and model."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.support.real_server import CHAT_HELLO, TEXT_ONCE, data_chunks, parse_sse, wait_idle

pytestmark = pytest.mark.integration


def _check_envelope(chunks: list[dict], object_name: str, id_prefix: str) -> None:
    ids = {c["id"] for c in chunks}
    created = {c["created"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith(id_prefix), ids
    assert len(created) == 1 and isinstance(next(iter(created)), int), created
    assert {c["object"] for c in chunks} == {object_name}
    for c in chunks:
        assert isinstance(c["choices"], list)
        for choice in c["choices"]:
            assert type(choice["index"]) is int


def test_curl_chat_stream_contract(base: str, model_id: str) -> None:
    wait_idle(base)
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT_HELLO, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers.get("x-accel-buffering") == "no"
    assert "content-encoding" not in r.headers

    chunks = data_chunks(parse_sse(r.content))
    _check_envelope(chunks, "chat.completion.chunk", "chatcmpl-")
    assert {c["model"] for c in chunks} == {model_id}
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)

    first, *content, last = chunks
    # 1. role frame: delta exactly {"role": "assistant"}, no content, no finish
    assert first["choices"][0]["delta"] == {"role": "assistant"}
    assert first["choices"][0].get("finish_reason") is None
    # 2. content chunks: content only, never role, never empty, never finished
    assert content, "the model produced no content chunks"
    for c in content:
        choice = c["choices"][0]
        assert set(choice["delta"]) == {"content"}, choice["delta"]
        assert isinstance(choice["delta"]["content"], str) and choice["delta"]["content"] != ""
        assert choice.get("finish_reason") is None
    # 3. terminal chunk: delta {} and a real finish_reason
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    # max_tokens 16: at most 16 content pieces; 'length' means exactly the budget was spent
    assert len(content) <= 16
    # 4. exactly one [DONE], last (checked by data_chunks); nothing else carries usage
    assert all("usage" not in c for c in chunks)


def test_curl_text_stream_contract(base: str, model_id: str) -> None:
    wait_idle(base)
    r = httpx.post(f"{base}/v1/completions", json=TEXT_ONCE, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")

    chunks = data_chunks(parse_sse(r.content))
    _check_envelope(chunks, "text_completion", "cmpl-")
    assert {c["model"] for c in chunks} == {model_id}
    *body, last = chunks
    assert body, "no text chunks"
    for c in body:
        choice = c["choices"][0]
        assert choice["index"] == 0
        assert isinstance(choice["text"], str) and choice["text"] != ""
        assert choice.get("finish_reason") is None
        assert "delta" not in choice
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["choices"][0]["text"] == ""
    text = "".join(c["choices"][0]["text"] for c in body)
    assert text.strip() and "\ufffd" not in text

    # non-streaming: the same completion's token count; 'length' means all 32 were used
    r2 = httpx.post(f"{base}/v1/completions", json={**TEXT_ONCE, "stream": False}, timeout=60)
    usage = r2.json()["usage"]
    if r2.json()["choices"][0]["finish_reason"] == "length":
        assert usage["completion_tokens"] == 32
    assert usage["completion_tokens"] <= 32


def test_sdk_snippet_local_model(base: str, client: OpenAI, model_id: str) -> None:
    """The Python SDK example verbatim (model="local-model", no max_tokens), plus checks."""
    stream = client.chat.completions.create(
        model="local-model",
        messages=[{"role": "user", "content": "Hello!"}],
        stream=True,
        max_tokens=24,  # keeps the suite fast; the snippet itself sets no limit
    )
    pieces = []
    roles = []
    finishes = []
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        assert chunk.model == model_id  # any name selects the one served model
        delta = chunk.choices[0].delta
        if delta.role is not None:
            roles.append(delta.role)
        if delta.content:
            pieces.append(delta.content)
        if chunk.choices[0].finish_reason is not None:
            finishes.append(chunk.choices[0].finish_reason)
    assert roles == ["assistant"]
    assert finishes in (["stop"], ["length"])
    assert len(ids) == 1
    assert "".join(pieces).strip()


def test_sdk_snippet_without_token_limit(client: OpenAI) -> None:
    """The snippet with no max_tokens at all: the server's default limit (until EOS) must end
    the answer on its own with one 'stop'. Greedy, so the length is deterministic (~50
    tokens on SmolLM2), not a random walk to the end of the context."""
    stream = client.chat.completions.create(
        model="local-model",
        messages=[{"role": "user", "content": "Hello!"}],
        stream=True,
        temperature=0,
    )
    text = ""
    finishes = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content:
            text += delta.content
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert text.strip()
    assert finishes == ["stop"]
