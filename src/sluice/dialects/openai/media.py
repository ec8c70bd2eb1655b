"""The rest of OpenAI's API for upstream models: images, audio and rerank pass through.

``/v1/images/generations`` (and ``edits``, ``variations``), ``/v1/audio/speech``,
``/v1/audio/transcriptions``, ``/v1/audio/translations`` and ``/v1/rerank`` name a
model in their JSON body or multipart form; a model of an upstream slot gets the
request as it came (only ``model`` renamed to the upstream's name, a form re-encoded
then), behind the same keys, and its answer's bytes come back unchanged. A local
model serves none of them: a 400 that says what it does not serve; an unknown model
is a 404.

Example::

    curl localhost:8080/v1/images/generations -d '{"model": "up-sdxl", "prompt": "a fox"}'
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidRequest, ModelNotFound
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
