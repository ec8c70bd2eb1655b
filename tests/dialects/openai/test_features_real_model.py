"""Request options on the real model: logprobs, usage chunk, seed, stop, limits, n, cache."""

from __future__ import annotations

import math

import httpx
import pytest
from openai import OpenAI

from tests.support.real_server import chat_text, data_chunks, parse_sse, wait_idle

pytestmark = pytest.mark.integration

COLOR = [{"role": "user", "content": "Name a color and describe it."}]


def _stream(base: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{base}{path}", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    return data_chunks(parse_sse(r.content))


def _check_chat_logprob_entry(entry: dict, top_n: int) -> None:
    assert set(entry) >= {"token", "logprob", "bytes", "top_logprobs"}
    assert isinstance(entry["token"], str)
    assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
    assert isinstance(entry["bytes"], list) and all(0 <= b < 256 for b in entry["bytes"])
    assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    tops = entry["top_logprobs"]
    assert len(tops) == top_n
    for t in tops:
        assert set(t) >= {"token", "logprob", "bytes"}
        assert math.isfinite(t["logprob"]) and t["logprob"] <= 0
    values = [t["logprob"] for t in tops]
    assert values == sorted(values, reverse=True)
    # greedy: the chosen token is the most likely one
    assert tops[0]["token"] == entry["token"]
    assert math.isclose(tops[0]["logprob"], entry["logprob"], abs_tol=1e-6)


def test_chat_logprobs_non_streamed(base: str) -> None:
    wait_idle(base)
    body = {
        "messages": COLOR,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "ignore_eos": True,
    }
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    full = r.json()
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert set(lp) >= {"content"} and lp.get("refusal") is None
    entries = lp["content"]
    assert len(entries) == full["usage"]["completion_tokens"] == 8
    for e in entries:
        _check_chat_logprob_entry(e, 3)
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]


def test_chat_logprobs_streamed_match_non_streamed(base: str) -> None:
    wait_idle(base)
    body = {
        "messages": COLOR,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _stream(base, "/v1/chat/completions", body)
    entries = []
    for c in chunks:
        if not c["choices"]:
            continue
        choice = c["choices"][0]
        if choice["delta"].get("content"):
            assert choice["logprobs"] is not None, c
            got = choice["logprobs"]["content"]
            assert len(got) >= 1
            assert "".join(e["token"] for e in got) == choice["delta"]["content"]
            entries.extend(got)
        else:
            assert not (choice.get("logprobs") or {}).get("content")
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"] == 8
    for e in entries:
        _check_chat_logprob_entry(e, 2)

    full = httpx.post(
        f"{base}/v1/chat/completions", json={**body, "stream": False}, timeout=60
    ).json()
    ref = full["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == [e["token"] for e in ref]
    for a, b in zip(entries, ref):
        assert math.isclose(a["logprob"], b["logprob"], abs_tol=1e-3)


def test_chat_logprobs_via_sdk(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="local-model",
        messages=COLOR,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                for e in ch.logprobs.content:
                    assert math.isfinite(e.logprob)
                    assert len(e.top_logprobs) == 1
                    tokens.append(e.token)
    assert usage is not None and len(tokens) == usage.completion_tokens == 6


def test_text_logprobs_in_every_streamed_chunk(base: str) -> None:
    wait_idle(base)
    n = 3
    body = {
        "prompt": "The sky is",
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": n,
        "ignore_eos": True,
    }
    chunks = _stream(base, "/v1/completions", body)
    *content, last = chunks
    assert content
    text, offset, count = "", 0, 0
    for c in content:
        choice = c["choices"][0]
        lp = choice["logprobs"]
        assert lp is not None, c
        assert set(lp) >= {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        k = len(lp["tokens"])
        assert k >= 1
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == k
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"][0] == offset  # offsets continue across chunks
        for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert math.isfinite(val) and val <= 0
            assert isinstance(top, dict) and 1 <= len(top) <= n
            assert all(math.isfinite(v) for v in top.values())
            assert max(top, key=top.get) == tok  # greedy
        text += choice["text"]
        offset += len(choice["text"])
        count += k
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["logprobs"] is not None  # the final chunk carries it too
    assert count == 10

    full = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    flp = full["choices"][0]["logprobs"]
    assert full["choices"][0]["text"] == text
    assert len(flp["tokens"]) == full["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": COLOR, "max_tokens": 6}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6}),
    ],
)
def test_include_usage_one_final_chunk(base: str, path: str, body: dict) -> None:
    wait_idle(base)
    chunks = _stream(base, path, {**body, "stream_options": {"include_usage": True}})
    with_usage = [i for i, c in enumerate(chunks) if c.get("usage") is not None]
    assert with_usage == [len(chunks) - 1], "usage must be on the last chunk only"
    final = chunks[-1]
    assert final["choices"] == []
    u = final["usage"]
    assert u["prompt_tokens"] > 0 and 1 <= u["completion_tokens"] <= 6
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert type(u["prompt_tokens_details"]["cached_tokens"]) is int
    assert final["id"] == chunks[0]["id"]
    # without the option: no usage anywhere
    plain = _stream(base, path, body)
    assert all(c.get("usage") is None for c in plain)
    assert all(c["choices"] for c in plain)


def test_sdk_exposes_usage_chunk(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="local-model",
        messages=COLOR,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    pieces = sum(1 for c in chunks[:-1] if c.choices and c.choices[0].delta.content)
    assert pieces <= chunks[-1].usage.completion_tokens


def test_seed_reproducible_at_temperature(client: OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.chat.completions.create(
            model="local-model",
            messages=COLOR,
            max_tokens=20,
            temperature=0.8,
            seed=seed,
        )
        return r.choices[0].message.content or ""

    first, second = run(1234), run(1234)
    assert first and first == second
    # the seed does something: other seeds give other samples
    others = {run(s) for s in (1, 2, 3)}
    assert len(others | {first}) > 1


def test_seed_reproducible_streamed_text(base: str) -> None:
    wait_idle(base)
    body = {"prompt": "My favourite animal is", "max_tokens": 16, "temperature": 0.8, "seed": 77}
    a = "".join(c["choices"][0]["text"] for c in _stream(base, "/v1/completions", body))
    b = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert a and a == b


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_on_real_model(base: str, stream: bool) -> None:
    wait_idle(base)
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    words = ref.split()
    assert len(words) >= 4, ref
    stop = words[2]  # a word from the middle of the greedy answer
    cut = ref[: ref.index(stop)]
    req = {**body, "stop": [stop, "zzzq-never"]}
    if stream:
        chunks = _stream(base, "/v1/completions", req)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        out = httpx.post(f"{base}/v1/completions", json=req, timeout=60).json()
        text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
    assert text == cut
    assert stop not in text
    assert finish == "stop"


def test_stop_string_chat_sdk(client: OpenAI) -> None:
    kwargs: dict = {"model": "local-model", "messages": COLOR, "max_tokens": 30, "temperature": 0}
    ref = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    words = ref.split()
    assert len(words) >= 4, ref
    stop = words[3]
    got = client.chat.completions.create(**kwargs, stop=stop)
    assert got.choices[0].message.content == ref[: ref.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_max_completion_tokens_honoured(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="local-model",
        messages=COLOR,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    # it wins over max_tokens when both are given
    r = client.chat.completions.create(
        model="local-model",
        messages=COLOR,
        max_completion_tokens=3,
        max_tokens=9,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 3
    # streamed too
    stream = client.chat.completions.create(
        model="local-model",
        messages=COLOR,
        max_completion_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["length"]


def test_n_2_gives_two_choices(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="local-model",
        messages=COLOR,
        max_tokens=8,
        n=2,
        temperature=0.9,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_n_2_streamed(base: str) -> None:
    wait_idle(base)
    chunks = _stream(
        base,
        "/v1/chat/completions",
        {
            "messages": COLOR,
            "max_tokens": 6,
            "n": 2,
            "temperature": 0.9,
            "seed": 5,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert len(c["choices"]) == 1
        by_index[c["choices"][0]["index"]].append(c["choices"][0])
    for index, choices in by_index.items():
        assert choices[0]["delta"] == {"role": "assistant"}, index
        assert sum(1 for ch in choices if "role" in ch["delta"]) == 1
        finishes = [ch["finish_reason"] for ch in choices if ch["finish_reason"]]
        assert finishes == ["length"]
        assert choices[-1]["delta"] == {}
        assert chat_text(chunks, index)
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    # the prompt is shared: counted once
    single = httpx.post(
        f"{base}/v1/chat/completions", json={"messages": COLOR, "max_tokens": 1}, timeout=60
    ).json()
    assert chunks[-1]["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]


def test_prefix_cache_reused_on_next_turn(client: OpenAI) -> None:
    turn1 = [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {
            "role": "user",
            "content": "Explain in detail why the sky looks blue during the day "
            "and red at sunset, with all the physics involved.",
        },
    ]
    r1 = client.chat.completions.create(
        model="local-model", messages=turn1, max_tokens=12, temperature=0
    )
    assert r1.usage is not None
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And why is the ocean blue?"},
    ]
    r2 = client.chat.completions.create(
        model="local-model", messages=turn2, max_tokens=4, temperature=0
    )
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and cached > 0
    # the whole first-turn prompt was reused, not just a common system-prompt preamble
    assert cached >= r1.usage.prompt_tokens - 1, (cached, r1.usage.prompt_tokens)
    assert cached < r2.usage.prompt_tokens


def test_models_endpoints(client: OpenAI, model_id: str, base: str) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    # The default model first (loaded), then every other model the server knows.
    assert ids == [model_id, "gemma-3-270m"] and model_id == "smollm2-135m-instruct"
    states = {m.id: m.model_extra["status"] for m in models.data}  # type: ignore[index]
    assert states == {model_id: "loaded", "gemma-3-270m": "not_loaded"}
    # Aliases find the same model.
    assert client.models.retrieve("smollm2").id == model_id
    m = client.models.retrieve(model_id)
    assert m.id == model_id and m.object == "model"
    raw = httpx.get(f"{base}/v1/models/{model_id}", timeout=10).json()
    assert raw["meta"]["n_ctx"] == 2048 and raw["meta"]["chat_template"] is True


def test_health_shape(base: str) -> None:
    h = httpx.get(f"{base}/health", timeout=10).json()
    assert h["status"] == "ok"
    s = h["slots"]
    assert s["total"] == 4
    assert s["active"] + s["idle"] == s["total"]
    assert s["queued"] == 0
