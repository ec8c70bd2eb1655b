"""Audio on OpenAI's routes: ``input_audio`` parts and ``/v1/audio/transcriptions`` for a
local model (a 400 in OpenAI's shape for one that does not hear, and for bad clips),
through the official ``openai`` SDK; what a projector's header says it takes."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from sluice.models.gguf import projector_inputs
from tests.support.audio import tone, wav
from tests.support.fakes import ScriptedRunner
from tests.support.helpers import scripted_server

CLIP = wav(tone(440, 0.5, 16000), 16000)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def test_a_model_that_does_not_hear_says_so() -> None:
    audio = {"data": base64.b64encode(CLIP).decode(), "format": "wav"}
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "input_audio", "input_audio": audio},
    ]
    with scripted_server(ScriptedRunner()) as base:
        oai = client(base)
        with pytest.raises(openai.BadRequestError) as chat:
            oai.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": content}]
            )
        with pytest.raises(openai.BadRequestError) as heard:
            oai.audio.transcriptions.create(model="scripted", file=("clip.wav", CLIP, "audio/wav"))
        health = httpx.get(base + "/health", timeout=10)
    for exc in (chat.value, heard.value):
        assert exc.status_code == 400
        assert "The model 'scripted' does not accept audio" in exc.message
    assert health.status_code == 200


@pytest.mark.parametrize(
    ("form", "file", "param", "words"),
    [
        ({}, ("a.mp3", b"ID3\x04" + b"\0" * 99, "audio/mpeg"), "file", "audio is taken as WAV"),
        ({}, ("a.wav", b"not audio at all", "audio/wav"), "file", "no audio file"),
        ({}, None, "file", "'file' is required"),
        ({"response_format": "xml"}, ("a.wav", CLIP, "audio/wav"), "response_format", "json"),
        ({"temperature": "hot"}, ("a.wav", CLIP, "audio/wav"), "temperature", "number"),
        ({"stream": "true"}, ("a.wav", CLIP, "audio/wav"), "stream", "not supported"),
    ],
)
def test_bad_transcription_requests_are_400s(
    form: dict[str, str], file: tuple[str, bytes, str] | None, param: str, words: str
) -> None:
    files = {"file": file} if file is not None else {"other": ("x", b"x", "text/plain")}
    with scripted_server(ScriptedRunner()) as base:
        r = httpx.post(
            base + "/v1/audio/transcriptions",
            data={"model": "scripted", **form},
            files=files,
            timeout=30,
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_projector_s_header_says_what_it_takes(tmp_path: Path) -> None:
    import gguf

    def write(name: str, **keys: bool) -> Path:
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), "clip")
        for key, value in keys.items():
            writer.add_bool(f"clip.{key}", value)
        writer.add_tensor("x", np.zeros(4, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    assert projector_inputs(write("v.gguf", has_vision_encoder=True)) == ("image",)
    assert projector_inputs(write("a.gguf", has_audio_encoder=True)) == ("audio",)
    both = write("va.gguf", has_vision_encoder=True, has_audio_encoder=True)
    assert projector_inputs(both) == ("image", "audio")
    assert projector_inputs(write("old.gguf")) == ("image",)  # before the keys: vision
    assert projector_inputs(tmp_path / "missing.gguf") == ()
