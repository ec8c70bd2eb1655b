"""Google's Gemini API on the real app around a scripted runner: records streamed as SSE
and as a JSON array, the folded answer, calls as functionCall parts, usage, the keys
Google's clients send, and bad input as a 4xx in Google's shape."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.fakes import EOS, ScriptedRunner
from tests.support.helpers import scripted_server

BASE = "/v1beta/models/scripted"
HI = {"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}
KEY = "sk-gemini-key-01"


def sse(raw: str) -> list[dict[str, Any]]:
    return [json.loads(f[6:]) for f in raw.split("\n\n") if f.startswith("data: ")]


def test_streamed_as_sse_and_as_an_array_and_folded() -> None:
    runner = ScriptedRunner(default=[b"Hel", b"lo!", EOS])
    with scripted_server(runner) as base:
        streamed = httpx.post(f"{base}{BASE}:streamGenerateContent?alt=sse", json=HI)
        array = httpx.post(f"{base}{BASE}:streamGenerateContent", json=HI)
        whole = httpx.post(f"{base}{BASE}:generateContent", json=HI).json()
    assert streamed.headers["content-type"].startswith("text/event-stream")
    records = sse(streamed.text)
    texts = [p["text"] for r in records for p in r["candidates"][0]["content"]["parts"]]
    assert "".join(texts) == "Hello!"
    # The finish goes with the last parts, and only the last record has it.
    assert records[-1]["candidates"][0]["finishReason"] == "STOP"
    assert records[-1]["candidates"][0]["content"]["parts"]
    assert all("finishReason" not in r["candidates"][0] for r in records[:-1])
    usage = records[-1]["usageMetadata"]
    assert usage["candidatesTokenCount"] == 3
    assert usage["totalTokenCount"] == usage["promptTokenCount"] + 3
    assert len({r["responseId"] for r in records}) == 1
    assert array.headers["content-type"].startswith("application/json")
    assert [r["candidates"] for r in array.json()] == [r["candidates"] for r in records]
    assert whole["candidates"][0]["content"] == {"role": "model", "parts": [{"text": "Hello!"}]}
    assert whole["candidates"][0]["finishReason"] == "STOP"
    assert whole["usageMetadata"]["candidatesTokenCount"] == 3


def test_a_call_is_one_function_call_part_and_history_goes_back() -> None:
    call = b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    runner = ScriptedRunner(default=[call, EOS], n_ctx_seq=4096)
    tools = [
        {
            "functionDeclarations": [
                {
                    "name": "get_weather",
                    "description": "The weather",
                    "parameters": {
                        "type": "OBJECT",
                        "properties": {"city": {"type": "STRING"}},
                        "required": ["city"],
                    },
                }
            ]
        },
        {"googleSearch": {}},  # cannot run here: left out
    ]
    with scripted_server(runner) as base:
        answer = httpx.post(f"{base}{BASE}:generateContent", json={**HI, "tools": tools}).json()
        part = answer["candidates"][0]["content"]["parts"][0]
        history = {
            "contents": [
                HI["contents"][0],
                {"role": "model", "parts": [part]},
                {
                    "role": "user",
                    "parts": [{"functionResponse": {"name": "get_weather", "response": {"t": 21}}}],
                },
            ],
            "tools": tools,
        }
        again = httpx.post(f"{base}{BASE}:generateContent", json=history)
    assert part["functionCall"]["name"] == "get_weather"
    assert part["functionCall"]["args"] == {"city": "Paris"}
    assert answer["candidates"][0]["finishReason"] == "STOP"
    assert again.status_code == 200, again.text
    prompt = "".join(chr(t) for t in runner.samplers[-1].prompt)
    assert '{"t": 21}' in prompt and "get_weather" in prompt


def test_keys_as_google_s_clients_send_them() -> None:
    with scripted_server(ScriptedRunner(), api_key=KEY) as base:
        header = httpx.post(
            f"{base}{BASE}:generateContent", json=HI, headers={"x-goog-api-key": KEY}
        )
        query = httpx.post(f"{base}{BASE}:generateContent?key={KEY}", json=HI)
        wrong = httpx.post(f"{base}{BASE}:generateContent?key=sk-wrong-0000", json=HI)
        listed = httpx.get(f"{base}/v1beta/models", headers={"x-goog-api-key": KEY})
    assert header.status_code == 200 and query.status_code == 200
    assert wrong.status_code == 401
    assert wrong.json()["error"]["status"] == "UNAUTHENTICATED"
    assert [m["name"] for m in listed.json()["models"]] == ["models/scripted"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        (":generateContent", {"contents": []}, 400, "'contents' is empty"),
        (":generateContent", "{not json", 400, "JSON"),
        (":generateContent", {"contents": "x"}, 400, "contents"),
        (
            ":generateContent",
            {"contents": [{"role": "user", "parts": [{"videoData": {}}]}]},
            400,
            "unknown part kind 'videoData'",
        ),
        (
            ":generateContent",
            {"contents": [{"role": "narrator", "parts": [{"text": "x"}]}]},
            400,
            "role",
        ),
        (
            ":generateContent",
            {**HI, "generationConfig": {"temperature": 9}},
            400,
            "temperature",
        ),
        (
            ":generateContent",
            {**HI, "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}},
            400,
            "function declarations",
        ),
        (
            ":generateContent",
            {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "aGk="}}]}]},
            400,
            "images",
        ),
        (":generateContent", {"contents": [HI["contents"][0]] * 5000}, 400, "--max-messages"),
        (":teleport", HI, 404, "not a method"),
        ("%2F..%2Fx:generateContent", HI, 404, ""),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_in_google_s_shape(
    path: str, body: Any, status: int, words: str
) -> None:
    with scripted_server(ScriptedRunner(), strict_model_names=True) as base:
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(f"{base}{BASE}{path}", content=content, timeout=30)
        odd = httpx.post(f"{base}/v1beta/models/n%C3%B6pe%00:generateContent", json=HI)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["status"] in ("INVALID_ARGUMENT", "NOT_FOUND")
    assert words in error["message"], error
    assert odd.status_code == 404 and odd.json()["error"]["status"] == "NOT_FOUND"


def test_count_tokens_and_models() -> None:
    with scripted_server(ScriptedRunner()) as base:
        count = httpx.post(f"{base}{BASE}:countTokens", json=HI).json()
        whole = httpx.post(f"{base}{BASE}:countTokens", json={"generateContentRequest": HI}).json()
        one = httpx.get(f"{base}/v1beta/models/scripted").json()
        missing = httpx.get(f"{base}/v1beta/models/nope")
    assert count["totalTokens"] > 0 and whole == count
    assert one["name"] == "models/scripted"
    assert "generateContent" in one["supportedGenerationMethods"]
    assert missing.status_code == 404 and missing.json()["error"]["status"] == "NOT_FOUND"


def test_methods_under_v1_too_with_google_s_errors() -> None:
    with scripted_server(ScriptedRunner()) as base:
        ok = httpx.post(f"{base}/v1/models/scripted:generateContent", json=HI)
        bad = httpx.post(f"{base}/v1/models/scripted:generateContent", json={"contents": []})
        openai = httpx.get(f"{base}/v1/models").json()
    assert ok.status_code == 200 and ok.json()["candidates"]
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert openai["object"] == "list"  # GET /v1/models stays OpenAI's


def test_embed_content_one_and_a_batch() -> None:
    with scripted_server(ScriptedRunner()) as base:
        one = httpx.post(
            f"{base}{BASE}:embedContent", json={"content": {"parts": [{"text": "hello"}]}}
        )
        batch = httpx.post(
            f"{base}{BASE}:batchEmbedContents",
            json={
                "requests": [
                    {"model": "models/scripted", "content": {"parts": [{"text": t}]}}
                    for t in ("a", "b", "c")
                ]
            },
        )
        bad = httpx.post(f"{base}{BASE}:embedContent", json={"content": {"parts": [{}]}})
    values = one.json()["embedding"]["values"]
    assert one.status_code == 200 and len(values) > 0 and isinstance(values[0], float)
    assert [len(e["values"]) for e in batch.json()["embeddings"]] == [len(values)] * 3
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_text_and_image_parts_keep_their_order() -> None:
    """Where an image stands among the text is what the model sees: an image first stays
    first (Gemma 3 with its projector answered a picture's colour only so)."""
    from sluice.dialects.gemini.schema import GenerateContentRequest

    image = {"inlineData": {"mimeType": "image/png", "data": "aGk="}}
    body = GenerateContentRequest.model_validate(
        {"contents": [{"role": "user", "parts": [image, {"text": "Its colour is"}, image]}]}
    )
    (message,) = body.messages()
    assert [p["type"] for p in message["content"]] == ["image_url", "text", "image_url"]
    only_text = GenerateContentRequest.model_validate(
        {"contents": [{"parts": [{"text": "a"}, {"text": "b"}]}]}
    )
    assert only_text.messages() == [{"role": "user", "content": "a\nb"}]
