"""Audio on the real SmolLM2 with a projector the suite makes itself (an Ultravox-style
projector that hears a low tone as " low" and a high one as " high",
``tests/support/audio_projector.py``): through the official ``openai`` SDK, the model says
which tone it heard, in a chat's ``input_audio`` part and in a transcription."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.audio_projector import (
    HIGH_HZ,
    LOW_HZ,
    TOKENS_PER_CHUNK,
    tone_projector,
    tone_wav,
)
from tests.support.real_server import QUIET, wait_idle
from tests.support.servers import serve_process

pytestmark = pytest.mark.integration

# Measured at temperature 0, the text before the clip: a low tone -> "low low low ...", a
# high one -> "high high high ..."; the text alone -> "AUDIO-CONTRADURAL". ("Is this tone low
# or high?" alone already answers "The tone is low".)
ASK = "Name the pitch of this sound in one word."
TONES = [(LOW_HZ, "low"), (HIGH_HZ, "high")]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with serve_process("--mmproj", str(tone_projector()), *QUIET) as url:
        yield url


@pytest.fixture
def oai(base: str) -> openai.OpenAI:
    wait_idle(base, within=10)
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def messages(clip: bytes, text: str = ASK) -> Any:
    data = base64.b64encode(clip).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
            ],
        }
    ]


def ask(client: openai.OpenAI, clip: bytes, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=messages(clip), temperature=0, max_tokens=8, **kw
    )


def other(word: str) -> str:
    return "high" if word == "low" else "low"


def test_the_model_lists_audio(base: str) -> None:
    models = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    smollm2 = next(m for m in models if "smollm2" in m["aliases"])
    assert "audio" in smollm2["modalities"]["input"]


@pytest.mark.parametrize(("hz", "word"), TONES)
def test_the_model_names_the_tone_it_hears(oai: openai.OpenAI, hz: float, word: str) -> None:
    whole = ask(oai, tone_wav(hz))
    answer = whole.choices[0].message.content.lower()
    assert word in answer and other(word) not in answer
    text_only = oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=8
    )
    assert word not in text_only.choices[0].message.content.lower()
    # The clip (padded to one 30 s window) is its 15 rows in the prompt.
    assert whole.usage.prompt_tokens == text_only.usage.prompt_tokens + TOKENS_PER_CHUNK
    streamed = ask(oai, tone_wav(hz), stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_same_clip_again_is_a_cache_hit(oai: openai.OpenAI) -> None:
    clip = tone_wav(LOW_HZ, seconds=2.0)
    first = ask(oai, clip)
    again = ask(oai, clip)
    assert again.choices[0].message.content == first.choices[0].message.content
    # Everything but the last prompt token from the cache, the clip's rows included.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    # Another clip after the same text is not taken for the first.
    high = ask(oai, tone_wav(HIGH_HZ, seconds=2.0))
    assert "high" in high.choices[0].message.content.lower()
    assert high.usage.prompt_tokens_details.cached_tokens < high.usage.prompt_tokens - 1


def test_a_clip_over_30_seconds_is_two_windows(oai: openai.OpenAI) -> None:
    short = ask(oai, tone_wav(LOW_HZ))
    long = ask(oai, tone_wav(LOW_HZ, seconds=33.0))  # 30 s, then 3 s padded to 30
    assert "low" in long.choices[0].message.content.lower()
    assert long.usage.prompt_tokens == short.usage.prompt_tokens + TOKENS_PER_CHUNK


@pytest.mark.parametrize(("hz", "word"), TONES)
def test_a_transcription_hears_the_tone(oai: openai.OpenAI, hz: float, word: str) -> None:
    # Measured: "The audio is: low low low ..." (cut at 64 + 8 tokens a second).
    clip = ("tone.wav", tone_wav(hz), "audio/wav")
    text = oai.audio.transcriptions.create(model="smollm2", file=clip, temperature=0).text
    assert word in text.lower() and other(word) not in text.lower()
    verbose = oai.audio.transcriptions.create(
        model="smollm2", file=clip, temperature=0, response_format="verbose_json"
    )
    assert verbose.text == text
    assert verbose.duration == pytest.approx(1.5)
    assert verbose.segments is not None and verbose.segments[0].end == pytest.approx(1.5)


@pytest.mark.parametrize(("hz", "word"), TONES)
def test_gemini_inline_audio_is_heard(base: str, hz: float, word: str) -> None:
    """Gemini's ``inlineData`` with an ``audio/*`` type (what Gemini CLI sends for an
    @-mentioned clip) through the official ``google-genai`` SDK: the same prompt as the
    OpenAI chat's ``input_audio`` part, the same answer."""
    from google import genai
    from google.genai import types

    wait_idle(base, within=10)
    client = genai.Client(
        api_key="x", http_options=types.HttpOptions(base_url=base, api_version="v1beta")
    )
    clip = tone_wav(hz)
    config = types.GenerateContentConfig(temperature=0, max_output_tokens=8)
    parts = [ASK, types.Part.from_bytes(data=clip, mime_type="audio/wav")]
    out = client.models.generate_content(model="smollm2", contents=parts, config=config)
    assert out.text is not None
    assert word in out.text.lower() and other(word) not in out.text.lower()
    oai = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    same = ask(oai, clip)
    assert out.text == same.choices[0].message.content
    assert out.usage_metadata is not None and same.usage is not None
    assert out.usage_metadata.prompt_token_count == same.usage.prompt_tokens
