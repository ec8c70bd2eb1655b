"""Images on the real SmolLM2 with a projector the suite makes itself (a colour-seeing
mlp projector, ``tests/support/projector.py``): the model answers what colour it was
shown, through the official SDKs, and bad images are 400s that harm nothing."""

from __future__ import annotations

import base64
import concurrent.futures
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.support.projector import colour_projector, solid_png
from tests.support.real_server import QUIET, wait_idle
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

ASK = "Name the colour of this image in one word."  # (text alone is answered "blue")
RED, GREEN = (230, 20, 20), (20, 200, 30)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with serve_process("--mmproj", str(colour_projector("smollm2")), *QUIET) as url:
        yield url


@pytest.fixture
def oai(base: str) -> openai.OpenAI:
    wait_idle(base, within=10)
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def data_uri(rgb: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + base64.b64encode(solid_png(rgb)).decode()


def openai_messages(url: str, text: str = ASK) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def ask(client: openai.OpenAI, url: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=openai_messages(url), temperature=0, max_tokens=12, **kw
    )


@pytest.mark.parametrize(("rgb", "word"), [(RED, "red"), (GREEN, "green")])
def test_the_model_names_the_colour_it_is_shown(oai: openai.OpenAI, rgb: Any, word: str) -> None:
    whole = ask(oai, data_uri(rgb))
    assert word in whole.choices[0].message.content.lower()
    text_only = oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=12
    )
    assert word not in text_only.choices[0].message.content.lower()
    # The image is its 16 rows in the prompt, counted as prompt tokens.
    assert whole.usage.prompt_tokens == text_only.usage.prompt_tokens + 16
    streamed = ask(oai, data_uri(rgb), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content


def test_two_images_at_once_stay_apart(oai: openai.OpenAI) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [
            (word, pool.submit(ask, oai, data_uri(rgb)))
            for word, rgb in [("red", RED), ("green", GREEN), ("red", RED), ("green", GREEN)]
        ]
        for word, job in jobs:
            assert word in job.result().choices[0].message.content.lower()


def test_anthropic_image_blocks_and_the_cache_knows_the_image(base: str) -> None:
    wait_idle(base, within=10)
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    png = base64.b64encode(solid_png(GREEN)).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    content = [{"type": "text", "text": ASK}, image]
    messages: Any = [{"role": "user", "content": content}]
    first = client.messages.create(
        model="smollm2", max_tokens=12, messages=messages, extra_body={"temperature": 0}
    )
    again = client.messages.create(
        model="smollm2", max_tokens=12, messages=messages, extra_body={"temperature": 0}
    )
    assert "green" in first.content[0].text.lower()  # type: ignore[union-attr]
    assert again.content == first.content
    # The same image and prompt again: everything but the last token from the cache.
    assert (again.usage.cache_read_input_tokens or 0) >= 16
    # Another image with the same text is not taken for the first one.
    png = base64.b64encode(solid_png(RED)).decode()
    other = [{"type": "text", "text": ASK}, {**image, "source": {**image["source"], "data": png}}]
    red = client.messages.create(
        model="smollm2",
        max_tokens=12,
        messages=[{"role": "user", "content": other}],
        extra_body={"temperature": 0},
    )
    assert "red" in red.content[0].text.lower()  # type: ignore[union-attr]


def test_ollama_images_on_chat_and_generate(base: str) -> None:
    wait_idle(base, within=10)
    client = ollama.Client(host=base, timeout=120)
    options = {"temperature": 0, "num_predict": 12}
    chat = client.chat(
        model="smollm2",
        messages=[{"role": "user", "content": ASK, "images": [solid_png(RED)]}],
        options=options,
    )
    assert "red" in chat.message.content.lower()
    parts = client.generate(
        model="smollm2", prompt=ASK, images=[solid_png(GREEN)], options=options, stream=True
    )
    assert "green" in "".join(p.response for p in parts).lower()


def png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


BAD = {
    "not an image": "data:image/png;base64,"
    + base64.b64encode(b"#!/bin/sh\necho hi\n" * 8).decode(),
    "a truncated PNG": "data:image/png;base64," + base64.b64encode(solid_png(RED)[:40]).decode(),
    "20,000 x 20,000 pixels": "data:image/png;base64,"
    + base64.b64encode(png_claiming(20_000, 20_000)).decode(),
    "bad base64": "data:image/png;base64,@@@notbase64@@@",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_are_400s_and_harm_nothing(base: str, case: str) -> None:
    wait_idle(base, within=10)
    body = {"model": "smollm2", "max_tokens": 4, "messages": openai_messages(BAD[case])}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(base + "/health", timeout=5).status_code == 200


def test_too_many_images_and_a_model_that_cannot_see(base: str) -> None:
    wait_idle(base, within=10)
    many = [{"type": "image_url", "image_url": {"url": data_uri(RED)}}] * 17
    body = {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": many}]}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "at most 16" in r.json()["error"]["message"]
    # The second packaged model was given no projector.
    body = {"model": "gemma3-270m", "max_tokens": 4, "messages": openai_messages(data_uri(RED))}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert "has no vision projector" in r.json()["error"]["message"]
