"""The OpenAI SSE stream contract, end to end: scripted runner, real engine, real HTTP.

The stream contract of llama.cpp's server and the OpenAI SDKs (chunk order,
terminal frames, logprobs in text chunks), and what clients trip over: one
id/created, role once, finish_reason null until one final chunk, one [DONE],
headers, UTF-8 split across tokens, stop strings, usage, n > 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.fakes import EOS, ScriptedRunner
from tests.support.helpers import (
    CHAT,
    TEXT,
    chat_text,
    finishes,
    post_stream,
    prompt_for,
    scripted_server,
    text_text,
    user,
)

CHARS = {"2-byte": "é", "3-byte": "€", "4-byte": "😀"}


@pytest.fixture(scope="module")
def runner() -> ScriptedRunner:
    # partial_keep=False: no prefix reuse, so repeated prompts report identical usage.
    return ScriptedRunner(partial_keep=False)


@pytest.fixture(scope="module")
def base(runner: ScriptedRunner) -> Iterator[str]:
    with scripted_server(runner, parallel=4, queue=16) as url:
        yield url


def chat_script(runner: ScriptedRunner, content: str, items: list[Any]) -> None:
    runner.scripts[prompt_for(content)] = items


def chat_stream(base: str, content: str, **kw: Any) -> list[dict[str, Any]]:
    res = post_stream(base, CHAT, {"messages": user(content), "stream": True, **kw})
    assert res.status == 200, res.body
    return res.chunks


def chat_once(base: str, content: str, **kw: Any) -> dict[str, Any]:
    r = httpx.post(base + CHAT, json={"messages": user(content), **kw}, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()


def assert_chat_contract(chunks: list[dict[str, Any]], n: int = 1) -> None:
    """One id and created, the role once, finish_reason null until one final chunk
    (a chat stream without include_usage)."""
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert len({c["created"] for c in chunks}) == 1 and type(chunks[0]["created"]) is int
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    for index in range(n):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant"} and mine[0]["finish_reason"] is None
        assert all("role" not in ch["delta"] for ch in mine[1:])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] in ("stop", "length")
        assert all(ch["finish_reason"] is None for ch in mine[:-1])
        for ch in mine[1:-1]:
            assert set(ch["delta"]) == {"content"} and ch["delta"]["content"] != ""
    for c in chunks:
        assert isinstance(c["choices"], list)
        assert all(type(ch["index"]) is int for ch in c["choices"])
        assert c.get("usage") is None


# -- chat frame order ---------------------------------------------------------------------


def test_chat_stream_bytes_in_exact_order(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "order", [b"Hi", b" there", EOS])
    res = post_stream(base, CHAT, {"messages": user("order"), "stream": True})
    assert res.status == 200
    assert res.headers["content-type"].split(";")[0] == "text/event-stream"
    assert res.headers["cache-control"] == "no-cache"
    assert res.headers["x-accel-buffering"] == "no"
    assert "content-encoding" not in res.headers
    first = json.loads(res.body.split(b"\n\n", 1)[0][len(b"data: ") :])
    ident, created = first["id"], first["created"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": "scripted",
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    expected = (
        chunk({"role": "assistant"})
        + chunk({"content": "Hi"})
        + chunk({"content": " there"})
        + chunk({}, "stop")
        + b"data: [DONE]\n\n"
    )
    assert res.body == expected


def test_chat_stream_contract_and_nonstream_agree(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "agree", [b"The", b" \xe2\x82", b"\xac", b"5", b" fee", EOS])
    chunks = chat_stream(base, "agree")
    assert_chat_contract(chunks)
    assert chat_text(chunks) == "The €5 fee"
    full = chat_once(base, "agree")
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "The €5 fee"}
    assert full["choices"][0]["finish_reason"] == finishes(chunks)[0][0] == "stop"


def test_openai_sdk_parses_chat_stream(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "sdk", [b"Once", b" upon", b" a", b" time", EOS])
    client = OpenAI(base_url=base + "/v1", api_key="not-needed", max_retries=0)
    stream = client.chat.completions.create(
        model="local-model",
        messages=user("sdk"),
        stream=True,
        stream_options={"include_usage": True},
    )
    got = list(stream)
    assert got[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Once upon a time"
    assert [
        c.choices[0].finish_reason for c in got if c.choices and c.choices[0].finish_reason
    ] == ["stop"]
    assert got[-1].choices == [] and got[-1].usage is not None
    assert got[-1].usage.completion_tokens == 5  # four pieces and the EOS
    completion = client.completions.create(model="x", prompt="sdk text", max_tokens=3)
    assert completion.choices[0].text == "Hello world!"


# -- UTF-8 split across tokens ------------------------------------------------------------


@pytest.mark.parametrize("name", CHARS)
def test_utf8_split_at_every_byte_position(base: str, runner: ScriptedRunner, name: str) -> None:
    char = CHARS[name]
    data = char.encode()
    cases = [[data[:i], data[i:]] for i in range(1, len(data))] + [[bytes([b]) for b in data]]
    for k, pieces in enumerate(cases):
        content = f"utf8 {name} {k}"
        chat_script(runner, content, [b"<", *pieces, b">", *pieces, EOS])
        chunks = chat_stream(base, content)
        assert_chat_contract(chunks)
        assert chat_text(chunks) == f"<{char}>{char}"
        assert all("\ufffd" not in c["choices"][0]["delta"].get("content", "") for c in chunks)
        # The same through text completions, with logprobs: one entry per token.
        runner.scripts[content] = [b"<", *pieces, b">", EOS]
        res = post_stream(base, TEXT, {"prompt": content, "stream": True, "logprobs": 1})
        text_chunks = res.chunks
        assert text_text(text_chunks) == f"<{char}>"
        assert all("\ufffd" not in c["choices"][0]["text"] for c in text_chunks)
        lp_tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in text_chunks)
        assert lp_tokens == len(pieces) + 2


@pytest.mark.parametrize("how", ["eos", "max_tokens"])
def test_incomplete_trailing_utf8_is_dropped(base: str, runner: ScriptedRunner, how: str) -> None:
    content = f"trailing {how}"
    if how == "eos":
        chat_script(runner, content, [b"ok", b"\xf0\x9f\x98", EOS])
        extra: dict[str, Any] = {}
    else:
        chat_script(runner, content, [b"ok", b"\xf0\x9f\x98", b"\x80never"])
        extra = {"max_tokens": 2}
    chunks = post_stream(base, CHAT, {"messages": user(content), "stream": True, **extra}).chunks
    # A character cut in half by the end of the sequence is dropped, never sent as
    # U+FFFD; the token that carried its bytes is still counted.
    assert chat_text(chunks) == "ok"
    assert finishes(chunks) == {0: ["stop" if how == "eos" else "length"]}
    body = chat_once(base, content, **extra)
    assert body["choices"][0]["message"]["content"] == "ok"
    assert body["usage"]["completion_tokens"] == (3 if how == "eos" else 2)


# -- stop strings -----------------------------------------------------------------------------


def stop_case(
    base: str, runner: ScriptedRunner, content: str, items: list[Any], stop: Any, **kw: Any
) -> tuple[str, str, list[dict[str, Any]]]:
    chat_script(runner, content, items)
    chunks = chat_stream(base, content, stop=stop, **kw)
    assert_chat_contract(chunks)
    text, reason = chat_text(chunks), finishes(chunks)[0][0]
    full = chat_once(base, content, stop=stop, **kw)["choices"][0]
    assert (full["message"]["content"], full["finish_reason"]) == (text, reason)
    return text, reason, chunks


def test_stop_spanning_tokens_never_leaks(base: str, runner: ScriptedRunner) -> None:
    text, reason, chunks = stop_case(
        base,
        runner,
        "stop span",
        [b"Answer", b": 4", b"<", b"|e", b"nd", b"|>", b" junk", EOS],
        "<|end|>",
    )
    assert (text, reason) == ("Answer: 4", "stop")
    assert all("<" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_stop_inside_one_token_cuts_it(base: str, runner: ScriptedRunner) -> None:
    text, reason, _ = stop_case(
        base, runner, "stop inside", [b"one", b" two\n\nthree", b" four", EOS], "\n\n"
    )
    assert (text, reason) == ("one two", "stop")


def test_earliest_of_four_stops_wins(base: str, runner: ScriptedRunner) -> None:
    text, reason, _ = stop_case(
        base, runner, "stop four", [b"a", b"bcX", b"YZ", b"W", EOS], ["W", "XYZ", "YZ", "Q"]
    )
    assert (text, reason) == ("abc", "stop")


@pytest.mark.parametrize("how", ["eos", "max_tokens"])
def test_held_back_partial_stop_is_flushed(base: str, runner: ScriptedRunner, how: str) -> None:
    items: list[Any] = (
        [b"value", b" <", b"|e", EOS] if how == "eos" else [b"value", b" <", b"|e", b"nd|>"]
    )
    kw = {"max_tokens": 3} if how == "max_tokens" else {}
    text, reason, _ = stop_case(base, runner, f"stop flush {how}", items, "<|end|>", **kw)
    assert text == "value <|e"
    assert reason == ("stop" if how == "eos" else "length")


def test_stop_in_text_completions(base: str, runner: ScriptedRunner) -> None:
    runner.scripts["text stop"] = [b"1, 2", b", 3", b", 4", EOS]
    res = post_stream(base, TEXT, {"prompt": "text stop", "stream": True, "stop": ", 3"})
    assert text_text(res.chunks) == "1, 2"
    assert finishes(res.chunks) == {0: ["stop"]}


# -- text completions --------------------------------------------------------------------------


def test_text_stream_shape_and_logprobs_per_token(base: str, runner: ScriptedRunner) -> None:
    runner.scripts["tc lp"] = [b"Hel", b"lo", b" \xe2\x82", b"\xac", EOS]
    res = post_stream(
        base, TEXT, {"prompt": "tc lp", "stream": True, "logprobs": 2, "max_tokens": 10}
    )
    chunks = res.chunks
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert len({c["created"] for c in chunks}) == 1
    assert text_text(chunks) == "Hello €"
    offset = 0
    tokens: list[str] = []
    for c in chunks:
        choice = c["choices"][0]
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        n = len(lp["tokens"])
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert all(isinstance(x, float) for x in lp["token_logprobs"])
        assert all(len(t) == 2 for t in lp["top_logprobs"])
        if n:
            assert lp["text_offset"][0] == offset
        offset += len(choice["text"])
        tokens += lp["tokens"]
    assert len(tokens) == 4  # one entry per emitted token (the EOS emits no text)
    assert finishes(chunks) == {0: ["stop"]}
    full = httpx.post(base + TEXT, json={"prompt": "tc lp", "logprobs": 2}).json()
    assert full["choices"][0]["logprobs"]["tokens"] == tokens


def test_text_echo_without_logprobs(base: str, runner: ScriptedRunner) -> None:
    runner.scripts["echo me"] = [b" and", b" more", EOS]
    res = post_stream(base, TEXT, {"prompt": "echo me", "stream": True, "echo": True})
    chunks = res.chunks
    assert chunks[0]["choices"][0]["text"] == "echo me"
    assert text_text(chunks) == "echo me and more"
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)
    full = httpx.post(base + TEXT, json={"prompt": "echo me", "echo": True}).json()
    assert full["choices"][0]["text"] == "echo me and more"
    assert full["usage"]["completion_tokens"] == 3


def test_text_echo_with_logprobs(base: str, runner: ScriptedRunner) -> None:
    prompt = "echo lp"
    runner.scripts[prompt] = [b" yes", b"!", EOS]
    res = post_stream(base, TEXT, {"prompt": prompt, "stream": True, "echo": True, "logprobs": 1})
    chunks = res.chunks
    assert text_text(chunks) == "echo lp yes!"
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    lps = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    offsets = [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == list(prompt) + [" yes", "!"]
    assert lps[0] is None and all(isinstance(x, float) for x in lps[1:])
    assert offsets == [0, 1, 2, 3, 4, 5, 6, 7, 11]
    assert [text_text(chunks)[o] for o in offsets] == [t[0] for t in tokens]


def test_text_list_of_prompts_and_n(base: str, runner: ScriptedRunner) -> None:
    runner.scripts["p one"] = [b"first", EOS]
    runner.scripts["p two"] = [b"second", b" answer", EOS]
    res = post_stream(
        base,
        TEXT,
        {
            "prompt": ["p one", "p two"],
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = res.chunks
    usage = chunks[-1]
    assert usage["choices"] == []
    chunks = chunks[:-1]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}
    assert [text_text(chunks, i) for i in range(4)] == [
        "first",
        "first",
        "second answer",
        "second answer",
    ]
    assert finishes(chunks) == {0: ["stop"], 1: ["stop"], 2: ["stop"], 3: ["stop"]}
    # Each distinct prompt is counted once; every choice's tokens count.
    assert usage["usage"]["prompt_tokens"] == len("p one") + len("p two")
    assert usage["usage"]["completion_tokens"] == 2 + 2 + 3 + 3


def test_chat_n_greater_than_one(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "chat n", [b"same", b" text", EOS])
    chunks = chat_stream(base, "chat n", n=3)
    assert_chat_contract(chunks, n=3)
    assert [chat_text(chunks, i) for i in range(3)] == ["same text"] * 3
    assert finishes(chunks) == {0: ["stop"], 1: ["stop"], 2: ["stop"]}
    full = chat_once(base, "chat n", n=3)
    assert [c["index"] for c in full["choices"]] == [0, 1, 2]
    assert full["usage"]["prompt_tokens"] == len(prompt_for("chat n"))
    assert full["usage"]["completion_tokens"] == 9


# -- usage --------------------------------------------------------------------------------------


def test_include_usage_one_final_chunk(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "usage", [b"a", b"b", b"c", EOS])
    res = post_stream(
        base,
        CHAT,
        {"messages": user("usage"), "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = res.chunks
    with_usage = [c for c in chunks if c.get("usage") is not None]
    assert with_usage == [chunks[-1]]
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(prompt_for("usage"))
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert type(usage["prompt_tokens_details"]["cached_tokens"]) is int
    assert finishes(chunks) == {0: ["stop"]}
    # The usage chunk comes after the finish chunk and right before [DONE].
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert res.body.endswith(b"\n\ndata: [DONE]\n\n")


def test_continuous_usage_on_every_chunk(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "cusage", [b"a", b"b", b"c", EOS])
    chunks = chat_stream(
        base, "cusage", stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert all(isinstance(c.get("usage"), dict) for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    assert all(type(c["usage"]["prompt_tokens_details"]["cached_tokens"]) is int for c in chunks)
    assert chunks[-1]["choices"] == []


def test_streaming_reassembled_equals_nonstreaming(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "same", [b"x\xf0\x9f", b"\x98\x80", b"y", b"STO", b"P", b"z", EOS])
    for kw in ({}, {"stop": "STOP"}, {"max_tokens": 2}):
        res = post_stream(
            base,
            CHAT,
            {
                "messages": user("same"),
                "stream": True,
                "stream_options": {"include_usage": True},
                **kw,
            },
        )
        chunks = res.chunks
        full = chat_once(base, "same", **kw)
        assert full["choices"][0]["message"]["content"] == chat_text(chunks[:-1])
        assert full["choices"][0]["finish_reason"] == finishes(chunks)[0][0]
        assert full["usage"] == chunks[-1]["usage"]
    runner.scripts["same text"] = [b"a", b"\xc3", b"\xa9", b"b", EOS]
    res = post_stream(
        base,
        TEXT,
        {
            "prompt": "same text",
            "stream": True,
            "logprobs": 0,
            "stream_options": {"include_usage": True},
        },
    )
    full = httpx.post(base + TEXT, json={"prompt": "same text", "logprobs": 0}).json()
    assert full["choices"][0]["text"] == text_text(res.chunks[:-1]) == "aéb"
    assert full["usage"] == res.chunks[-1]["usage"]
    streamed_tokens = [t for c in res.chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert full["choices"][0]["logprobs"]["tokens"] == streamed_tokens


# -- token limits -----------------------------------------------------------------------------


def test_max_tokens_and_max_completion_tokens(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "limits", [b"1", b"2", b"3", b"4", b"5", b"6", EOS])
    for field, n in (("max_tokens", 3), ("max_completion_tokens", 2)):
        chunks = chat_stream(base, "limits", **{field: n}, stream_options={"include_usage": True})
        assert chat_text(chunks[:-1]) == "123"[:n]
        assert finishes(chunks) == {0: ["length"]}
        assert chunks[-1]["usage"]["completion_tokens"] == n
    # max_completion_tokens wins over max_tokens when both are given.
    full = chat_once(base, "limits", max_tokens=5, max_completion_tokens=1)
    assert full["choices"][0]["message"]["content"] == "1"
    assert full["choices"][0]["finish_reason"] == "length"


def test_text_completion_default_max_tokens_is_16(base: str, runner: ScriptedRunner) -> None:
    runner.scripts["default limit"] = [b"t"] * 40
    full = httpx.post(base + TEXT, json={"prompt": "default limit"}).json()
    assert full["choices"][0]["text"] == "t" * 16
    assert full["choices"][0]["finish_reason"] == "length"


def test_end_of_context_is_length(base: str, runner: ScriptedRunner) -> None:
    chat_script(runner, "forever", [b"w"] * 400)
    n_prompt = len(prompt_for("forever"))
    chunks = chat_stream(base, "forever", stream_options={"include_usage": True})
    assert finishes(chunks) == {0: ["length"]}
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == runner.n_ctx_seq
    assert chat_text(chunks[:-1]) == "w" * (runner.n_ctx_seq - n_prompt)
    assert max(len(runner.history[s]) for s in runner.history) <= runner.n_ctx_seq


def test_no_empty_content_chunks_when_tokens_decide_nothing(
    base: str, runner: ScriptedRunner
) -> None:
    # Each split byte and each possible stop prefix is a step with nothing to send.
    chat_script(runner, "quiet", [b"\xf0", b"\x9f", b"\x98", b"\x80", b"<", b"<", b"x", EOS])
    chunks = chat_stream(base, "quiet", stop="<<<")
    assert_chat_contract(chunks)
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["😀", "<<x"]


def test_model_name_and_created_are_sane(base: str, runner: ScriptedRunner) -> None:
    chunks = chat_stream(base, "unscripted prompt")
    assert chat_text(chunks) == "Hello world!"
    assert {c["model"] for c in chunks} == {"scripted"}
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", chunks[0]["id"])
