"""Images on the real SmolLM2 with a projector the suite makes itself (a colour-seeing
mlp projector, ``tests/support/projector.py``): the model answers what colour it was
shown, through the official SDKs, and bad images are 400s that harm nothing."""

from __future__ import annotations

import base64
import concurrent.futures
import json
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


def test_responses_gemini_and_lm_studio_chat_take_images(oai: openai.OpenAI, base: str) -> None:
    from google import genai
    from google.genai import types

    content: Any = [
        {"type": "input_text", "text": ASK},
        {"type": "input_image", "image_url": data_uri(GREEN)},
    ]
    answer = oai.responses.create(
        model="smollm2",
        input=[{"role": "user", "content": content}],
        temperature=0,
        max_output_tokens=12,
    )
    assert "green" in answer.output_text.lower()

    gemini = genai.Client(
        api_key="unused", http_options=types.HttpOptions(base_url=base, api_version="v1beta")
    )
    parts = [
        types.Part(text=ASK),
        types.Part.from_bytes(data=solid_png(RED), mime_type="image/png"),
    ]
    config = types.GenerateContentConfig(temperature=0, max_output_tokens=12)
    said = gemini.models.generate_content(
        model="smollm2", contents=[types.Content(role="user", parts=parts)], config=config
    )
    assert "red" in (said.text or "").lower()
    streamed = gemini.models.generate_content_stream(
        model="smollm2", contents=[types.Content(role="user", parts=parts)], config=config
    )
    assert "".join(c.text or "" for c in streamed) == said.text

    body = {
        "model": "smollm2",
        "temperature": 0,
        "max_output_tokens": 12,
        "input": [{"type": "text", "content": ASK}, {"type": "image", "data_url": data_uri(GREEN)}],
    }
    r = httpx.post(base + "/api/v1/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = "".join(o.get("content", "") for o in r.json()["output"] if o["type"] == "message")
    assert "green" in text.lower()


def test_model_lists_say_which_models_see(base: str) -> None:
    models = httpx.get(base + "/v1/models", timeout=30).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id["smollm2-135m-instruct"]["modalities"]["input"] == ["text", "image"]
    assert "modalities" not in by_id["gemma-3-270m"]
    show = httpx.post(base + "/api/show", json={"model": "smollm2"}, timeout=30).json()
    assert "vision" in show["capabilities"]
    show = httpx.post(base + "/api/show", json={"model": "gemma3-270m"}, timeout=30).json()
    assert "vision" not in show["capabilities"]
    info = {m["id"]: m for m in httpx.get(base + "/v1/info", timeout=30).json()["models"]}
    assert info["smollm2-135m-instruct"]["capabilities"]["vision"] is True
    assert info["smollm2-135m-instruct"]["modalities"]["input"] == ["text", "image"]
    assert info["gemma-3-270m"]["capabilities"]["vision"] is False
    lms = httpx.get(base + "/api/v1/models", timeout=30).json()["models"]
    vision = {m["key"]: m["capabilities"]["vision"] for m in lms}
    assert vision["smollm2-135m-instruct"] is True and vision["gemma-3-270m"] is False
    # Gemini's Model has no field for it (every Gemini model sees); its limits stay the
    # window a load gives, loaded or not.
    gemini = httpx.get(base + "/v1beta/models", timeout=30).json()["models"]
    for model in gemini:
        window = info[model["baseModelId"]]["context_window"]
        assert model["inputTokenLimit"] == model["outputTokenLimit"] == window > 0
    one = httpx.get(base + "/v1beta/models/smollm2-135m-instruct", timeout=30).json()
    assert one["inputTokenLimit"] == info["smollm2-135m-instruct"]["context_window"]


@pytest.fixture(scope="module")
def picture_host() -> Iterator[str]:
    """A loopback HTTP server with /red.png, /green.png and a redirect to the red one."""
    import http.server
    import threading

    files = {"/red.png": solid_png(RED), "/green.png": solid_png(GREEN)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/red.png")
                self.end_headers()
                return
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_an_image_url_on_a_private_address_is_refused_before_any_connection(
    base: str, picture_host: str
) -> None:
    wait_idle(base, within=10)
    body = {
        "model": "smollm2",
        "max_tokens": 4,
        "messages": openai_messages(picture_host + "/red.png"),
    }
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "--download-allow-private" in r.json()["error"]["message"]


def test_image_urls_are_fetched_under_the_download_rules(picture_host: str) -> None:
    args = ("--mmproj", str(colour_projector("smollm2")), "--download-allow-private", *QUIET)
    with serve_process(*args) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert (
            "green" in ask(client, picture_host + "/green.png").choices[0].message.content.lower()
        )
        assert "red" in ask(client, picture_host + "/moved").choices[0].message.content.lower()
        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        image = {"type": "image", "source": {"type": "url", "url": picture_host + "/red.png"}}
        said = claude.messages.create(
            model="smollm2",
            max_tokens=12,
            messages=[{"role": "user", "content": [{"type": "text", "text": ASK}, image]}],
            extra_body={"temperature": 0},
        )
        assert "red" in said.content[0].text.lower()  # type: ignore[union-attr]
        body = {
            "model": "smollm2",
            "max_tokens": 4,
            "messages": openai_messages(picture_host + "/nope.png"),
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "answered 404" in r.json()["error"]["message"]


def test_gemma_3_sees_through_its_non_causal_projector(tmp_path: Any) -> None:
    """Gemma 3 270M (a base model: a template that writes the content alone) with the
    gemma3 colour projector: each image wrapped in <start_of_image>/<end_of_image> and
    its rows decoded with attention both ways; the answers llama-server gives."""
    template = tmp_path / "plain.jinja"
    template.write_text("{%- for m in messages %}{{ m.content }}{%- endfor %}")
    projector = str(colour_projector("gemma3"))
    args = ("--model", "gemma3-270m", "--mmproj", projector, "--chat-template", str(template))
    with serve_process(*args, *QUIET) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        said = {}
        for word, rgb in (("red", RED), ("green", GREEN), ("none", None)):
            content: list[dict[str, Any]] = [
                {"type": "text", "text": "\nThis picture is one solid colour. Its colour is"}
            ]
            if rgb is not None:
                content.insert(0, {"type": "image_url", "image_url": {"url": data_uri(rgb)}})
            answer = client.chat.completions.create(
                model="gemma3-270m",
                messages=[{"role": "user", "content": content}],  # type: ignore[misc]
                temperature=0,
                max_tokens=12,
            )
            said[word] = (answer.choices[0].message.content or "", answer.usage.prompt_tokens)  # type: ignore[union-attr]
    assert "red" in said["red"][0] and "green" in said["green"][0]
    assert "red" not in said["none"][0] and "green" not in said["none"][0]
    # 16 image rows and the two wrapping tokens (llama-server: 12 and 30 too).
    assert (said["none"][1], said["red"][1]) == (12, 30)


GEMMA_ASK = "\nThis picture is one solid colour. Its colour is"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("gemma") / "plain.jinja"
    template.write_text("{%- for m in messages %}{{ m.content }}{%- endfor %}")
    projector = str(colour_projector("gemma3"))
    args = ("--model", "gemma3-270m", "--mmproj", projector, "--chat-template", str(template))
    with serve_process(*args, *QUIET) as url:
        yield url


def _said(base: str, model: str, sdk: str, stream: bool, rgb: tuple[int, int, int]) -> str:
    """What ``model`` answers an image and its question through ``sdk``: Gemma 3 (a base
    model) the image first and text after it, SmolLM2 ASK and the image after it."""
    first = model == "gemma3-270m"
    text = GEMMA_ASK if first else ASK

    def order(image: Any, words: Any) -> list[Any]:
        return [image, words] if first else [words, image]

    png = solid_png(rgb)
    b64 = base64.b64encode(png).decode()
    if sdk in ("openai", "responses"):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        if sdk == "openai":
            content: Any = order(
                {"type": "image_url", "image_url": {"url": data_uri(rgb)}},
                {"type": "text", "text": text},
            )
            kw: Any = {"model": model, "temperature": 0, "max_tokens": 12}
            messages = [{"role": "user", "content": content}]
            if stream:
                chunks = client.chat.completions.create(messages=messages, stream=True, **kw)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return (
                client.chat.completions.create(messages=messages, **kw).choices[0].message.content
                or ""
            )
        content = order(
            {"type": "input_image", "image_url": data_uri(rgb)},
            {"type": "input_text", "text": text},
        )
        kw = {"model": model, "temperature": 0, "max_output_tokens": 12}
        items: Any = [{"role": "user", "content": content}]
        if stream:
            events = client.responses.create(input=items, stream=True, **kw)
            return "".join(e.delta for e in events if e.type == "response.output_text.delta")
        return client.responses.create(input=items, **kw).output_text
    if sdk == "anthropic":
        claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        source = {"type": "base64", "media_type": "image/png", "data": b64}
        blocks: Any = order({"type": "image", "source": source}, {"type": "text", "text": text})
        akw: Any = {"model": model, "max_tokens": 12, "extra_body": {"temperature": 0}}
        msgs: Any = [{"role": "user", "content": blocks}]
        if stream:
            with claude.messages.stream(messages=msgs, **akw) as s:
                return "".join(s.text_stream)
        return str(claude.messages.create(messages=msgs, **akw).content[0].text)  # type: ignore[union-attr]
    if sdk == "ollama":
        llama = ollama.Client(host=base, timeout=120)
        message = {"role": "user", "content": text, "images": [png]}
        options = {"temperature": 0, "num_predict": 12}
        if stream:
            parts = llama.chat(model=model, messages=[message], options=options, stream=True)
            return "".join(p.message.content or "" for p in parts)
        return llama.chat(model=model, messages=[message], options=options).message.content or ""
    if sdk == "gemini":
        from google import genai
        from google.genai import types

        client_g = genai.Client(
            api_key="unused", http_options=types.HttpOptions(base_url=base, api_version="v1beta")
        )
        parts_g = order(
            types.Part.from_bytes(data=png, mime_type="image/png"), types.Part(text=text)
        )
        contents = [types.Content(role="user", parts=parts_g)]
        config = types.GenerateContentConfig(temperature=0, max_output_tokens=12)
        if stream:
            chunks_g = client_g.models.generate_content_stream(
                model=model, contents=contents, config=config
            )
            return "".join(c.text or "" for c in chunks_g)
        return (
            client_g.models.generate_content(model=model, contents=contents, config=config).text
            or ""
        )
    body = {
        "model": model,
        "temperature": 0,
        "max_output_tokens": 12,
        "stream": stream,
        "input": order(
            {"type": "image", "data_url": data_uri(rgb)}, {"type": "text", "content": text}
        ),
    }
    r = httpx.post(base + "/api/v1/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return "".join(o.get("content", "") for o in r.json()["output"] if o["type"] == "message")
    said = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            if event.get("type") == "message.delta":
                said.append(event["content"])
    return "".join(said)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "sdk", ["openai", "responses", "anthropic", "ollama", "gemini", "lmstudio"]
)
@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_each_model_names_the_colour_through_every_sdk(
    request: pytest.FixtureRequest, model: str, sdk: str, stream: bool
) -> None:
    at = request.getfixturevalue("base" if model == "smollm2" else "gemma")
    wait_idle(at, within=10)
    red, green = (_said(at, model, sdk, stream, rgb).lower() for rgb in (RED, GREEN))
    assert "red" in red and "green" not in red, red
    assert "green" in green and "red" not in green, green
