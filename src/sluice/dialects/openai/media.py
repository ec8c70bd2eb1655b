"""The rest of OpenAI's API for upstream models: images, audio and rerank pass through.

``/v1/images/generations`` (and ``edits``, ``variations``), ``/v1/audio/speech``,
``/v1/audio/transcriptions``, ``/v1/audio/translations`` and ``/v1/rerank`` name a
model in their JSON body or multipart form; a model of an upstream slot gets the
request as it came (only ``model`` renamed to the upstream's name, a form re-encoded
then), behind the same keys, and its answer's bytes come back unchanged. A local
model serves none of them but one: a 400 that says what it does not serve; an unknown
model is a 404.

``/v1/audio/transcriptions`` on a local model whose projector has an audio encoder is
answered by the model itself (:func:`transcribe`): OpenAI's form (``file`` a WAV clip,
``model``, ``prompt``, ``language``, ``temperature``, ``response_format`` ``json``,
``text``, ``verbose_json``, ``srt`` or ``vtt``) as one chat turn that asks for the
transcript, the clip an ``input_audio`` part. There are no timestamps:
``verbose_json``, ``srt`` and ``vtt`` give one segment spanning the clip, and the
transcript is cut at 64 tokens plus 8 a second of audio.

Example::

    curl localhost:8080/v1/images/generations -d '{"model": "up-sdxl", "prompt": "a fox"}'
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import httpx
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidRequest, ModelNotFound, UnsupportedParameter
from sluice.core.fold import Fold
from sluice.core.media import decode_audio
from sluice.core.request import GenerationRequest, SamplingParams
from sluice.server.body import read_request_body
from sluice.server.jsonbody import parse_json_body
from sluice.server.respond import CLIENT_GONE, errors_as, forward
from sluice.server.sse import error_frame, error_response
from sluice.server.state import ServerState, server_state

# Path under /v1 -> what it serves (for the local model's 400).
WHAT = {
    "/images/generations": "image generation",
    "/images/edits": "image edits",
    "/images/variations": "image variations",
    "/audio/speech": "speech",
    "/audio/transcriptions": "transcription",
    "/audio/translations": "audio translation",
    "/rerank": "reranking",
}


def _replay(raw: bytes, request: Request) -> Request:
    """A request whose body is ``raw`` again (to parse a form from bytes already read)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(request.scope, receive)


async def _multipart(raw: bytes, request: Request) -> tuple[str | None, list[Any], list[Any]]:
    """(model, plain fields, file fields) of a multipart form."""
    form = await _replay(raw, request).form(max_files=64, max_fields=256)
    fields: list[tuple[str, str]] = []
    files: list[tuple[str, tuple[str | None, bytes, str | None]]] = []
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            files.append((key, (value.filename, await value.read(), value.content_type)))
        else:
            fields.append((key, value))
    model = next((v for k, v in fields if k == "model"), None)
    return model, fields, files


def _target(state: ServerState, model: object, path: str) -> Any:
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required", param="model")
    target = state.dispatcher.upstream(model)
    if target is None:
        state.registry.resolve(model)  # an unknown model: its 404 (with strict names)
        raise InvalidRequest(
            f"The model '{model}' is a local model: it does not serve {WHAT[path]} "
            "(only models of an upstream that does can).",
            param="model",
        )
    return target


@errors_as(error_response)
async def media(request: Request) -> Response:
    state = server_state(request)
    path = request.url.path.removeprefix("/v1")
    if path not in WHAT:
        raise ModelNotFound(path)
    raw = await read_request_body(request, state.settings.max_body_bytes, lambda: state.draining)
    if raw is None:
        return Response(status_code=CLIENT_GONE)
    content_type = request.headers.get("content-type", "")
    headers = {"accept": request.headers.get("accept") or "*/*"}
    if content_type.startswith("multipart/form-data"):
        model, fields, files = await _multipart(raw, request)
        if path == "/audio/transcriptions" and _local(state, model):
            return await transcribe(state, str(model), fields, files)
        target = _target(state, model, path)
        if model != target.model:  # an alias: the form again, with the upstream's name
            form: dict[str, list[str]] = {}
            for k, v in fields:
                form.setdefault(k, []).append(target.model if k == "model" else v)
            encoded = httpx.Request("POST", "http://x", data=form, files=files)
            raw = encoded.read()
            content_type = encoded.headers["content-type"]
    else:
        body = raw
        data = await state.offload.run(lambda: parse_json_body(body, state.limits))
        if not isinstance(data, dict):
            raise InvalidRequest("The body must be a JSON object")
        target = _target(state, data.get("model"), path)
        if data["model"] != target.model:
            data["model"] = target.model
            raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        content_type = "application/json"
    headers["content-type"] = content_type
    await state.dispatcher.admit(target)
    answer = await target.backend().passthrough(path, raw, headers)
    return await forward(
        request, state.settings, answer, failure_frame=error_frame, render_error=error_response
    )


# -- transcriptions on a local model ------------------------------------------------------

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
ASK = "Transcribe this audio word for word. Answer with the transcript alone."
# A transcript's length follows its clip's (speech is a few tokens a second): a model that
# does not stop is cut there, not at the end of its context.
TOKENS_BASE, TOKENS_PER_SECOND = 64, 8
FormFile = tuple[str, tuple[str | None, bytes, str | None]]


def _local(state: ServerState, model: object) -> bool:
    """``model`` names a local model (not an upstream's)."""
    return isinstance(model, str) and bool(model) and state.dispatcher.upstream(model) is None


async def transcribe(
    state: ServerState, model: str, fields: list[tuple[str, str]], files: list[FormFile]
) -> Response:
    """OpenAI's transcription, answered by a local model that hears (a 400 from the
    model for one that does not)."""
    form = dict(fields)
    clip = next((data for key, (_name, data, _type) in files if key == "file"), None)
    if clip is None:
        raise InvalidRequest("'file' is required: the audio to transcribe", param="file")
    fmt = form.get("response_format") or "json"
    if fmt not in FORMATS:
        raise InvalidRequest(
            f"'response_format' must be one of {', '.join(FORMATS)}", param="response_format"
        )
    if form.get("stream", "false").lower() not in ("false", "0", ""):
        raise UnsupportedParameter("stream", "is not supported for a local model's transcription")
    try:
        temperature = float(form.get("temperature") or 0)
    except ValueError:
        raise InvalidRequest("'temperature' must be a number", param="temperature") from None
    if not 0 <= temperature <= 1:
        raise InvalidRequest("'temperature' must be between 0 and 1", param="temperature")
    sound = await state.offload.run(lambda: decode_audio(clip, "file"))  # a 400 before a load
    ask = ASK
    if form.get("language"):
        ask += f" It is in the language '{form['language'][:32]}'."
    if form.get("prompt"):
        ask += f" What came before it: {form['prompt'][:2000]}"
    content = [
        {"type": "text", "text": ask},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode()}},
    ]
    neutral = GenerationRequest(
        model=model,
        messages=[{"role": "user", "content": content}],
        sampling=SamplingParams(temperature=temperature),
        max_tokens=TOKENS_BASE + math.ceil(TOKENS_PER_SECOND * sound.seconds),
    )
    lease, stream = await state.dispatcher.open(neutral)
    try:
        acc = Fold(stream.meta.prompt_owners)
        async for event in stream:
            acc.add(event)
    finally:
        await lease.close(stream)
    choices = acc.result().ordered()
    text = choices[0][1].content.strip() if choices else ""
    return _transcript(fmt, text, sound.seconds, form.get("language"))


def _transcript(fmt: str, text: str, seconds: float, language: str | None) -> Response:
    """The transcript in the ``response_format`` asked for."""
    if fmt == "json":
        return Response(json.dumps({"text": text}), media_type="application/json")
    if fmt == "text":
        return Response(text + "\n", media_type="text/plain; charset=utf-8")
    if fmt == "verbose_json":
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": round(seconds, 3), "text": text}
        body = {
            "task": "transcribe",
            "language": language or "unknown",
            "duration": round(seconds, 3),
            "text": text,
            "segments": [segment],
        }
        return Response(json.dumps(body), media_type="application/json")
    if fmt == "srt":
        cue = f"00:00:00,000 --> {_clock(seconds, ',')}"
        return Response(f"1\n{cue}\n{text}\n\n", media_type="text/plain; charset=utf-8")
    cue = f"00:00:00.000 --> {_clock(seconds, '.')}"
    return Response(f"WEBVTT\n\n{cue}\n{text}\n\n", media_type="text/vtt; charset=utf-8")


def _clock(seconds: float, comma: str) -> str:
    """``seconds`` as ``HH:MM:SS,mmm`` (SubRip) or ``HH:MM:SS.mmm`` (WebVTT)."""
    ms = round(seconds * 1000)
    return (
        f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{comma}{ms % 1000:03d}"
    )
