"""Google's Gemini API, for Gemini CLI and the ``google-genai`` SDKs: under ``/v1beta``,
``POST models/{model}:generateContent``, ``:streamGenerateContent`` (SSE with
``alt=sse``, else one JSON array streamed record by record), ``:countTokens``, and
``GET models`` and ``models/{model}``, on every backend (local and upstream, translated
through the neutral request); a model of an upstream with ``native_apis = ["gemini"]``
gets the body as it came (at ``/v1beta/models/<its name>:<method>``) and its bytes
come back unchanged.

Order of a request: before any byte (a real status, Google's error body) the body is
read within the size limit and validated (``schema.py``), images for a local model are
a 400, the slot is acquired and the request opened on it (a prompt over the context is
a 400 here); then the events become records (``format.py``). The model may come as
``x`` or ``models/x``, the ``:`` percent-encoded. Keys: ``x-goog-api-key`` or
``?key=`` beside ``Authorization: Bearer`` and ``x-api-key`` (``server/auth.py``).

Example::

    curl 'localhost:8080/v1beta/models/smollm2:streamGenerateContent?alt=sse' \\
      -d '{"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]}'
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode

import orjson
from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import InvalidRequest, ModelNotFound, NotFound, as_sluice_error
from sluice.core.events import ErrorEvent
from sluice.dialects.gemini.format import GeminiFormatter, error_body, error_frame, error_response
from sluice.dialects.gemini.resume import GeminiPartial
from sluice.dialects.gemini.schema import CountTokensRequest, GenerateContentRequest, parse
from sluice.metrics import GeminiRecordTap
from sluice.models.dispatch import UpstreamTarget
from sluice.models.files import context_window, read_all_model_files
from sluice.models.flights import identify
from sluice.server.jsonbody import check_body_limits, check_embed_inputs
from sluice.server.respond import CLIENT_GONE, count_prompt, errors_as, forward, respond
from sluice.server.sse import json_response, sse_stream
from sluice.server.state import ServerState, read_json, server_state
from sluice.upstream.backend import slot_header, upstream_context

log = logging.getLogger("sluice.api")

PREFIX = "/v1beta"
NATIVE = "gemini"  # an upstream's native_apis entry for this dialect
V1_MODELS = "/v1/models/"  # its methods are also served under /v1 (POST only)


def is_v1_method(path: str) -> bool:
    """A Gemini method under ``/v1`` (``/v1/models/x:generateContent``), not OpenAI's."""
    return path.startswith(V1_MODELS) and ":" in path


_METHODS = (
    "generateContent",
    "streamGenerateContent",
    "countTokens",
    "embedContent",
    "batchEmbedContents",
)


def _split(rest: str) -> tuple[str, str]:
    """``"models/x:generateContent"`` or ``"x:generateContent"`` -> (``x``, method)."""
    model, sep, method = rest.rpartition(":")
    if not sep or not model:
        raise NotFound(f"No route models/{rest[:64]}: expected models/MODEL:METHOD.")
    model = model.removeprefix("models/")
    if method not in _METHODS:
        raise NotFound(f"models/{model[:64]}:{method[:32]} is not a method sluice serves.")
    return model, method


@errors_as(error_response)
async def model_method(request: Request) -> Response:
    model, method = _split(request.path_params["rest"])
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    target = state.dispatcher.native(model, NATIVE)
    if target is not None:
        return await _passthrough(request, state, target, method, data)
    if method == "countTokens":
        return await _count_tokens(request, state, model, data)
    if method == "embedContent":
        return await _embed(state, model, [data], batch=False)
    if method == "batchEmbedContents":
        requests = data.get("requests")
        if not isinstance(requests, list):
            raise InvalidRequest("'requests' must be a list", param="requests")
        return await _embed(state, model, requests, batch=True)
    return await _generate(request, state, model, data, stream=method == "streamGenerateContent")


async def _generate(
    request: Request, state: ServerState, model: str, data: dict[str, Any], *, stream: bool
) -> Response:
    def validate() -> tuple[GenerateContentRequest, Any]:
        _check_limits(data, state)
        body = parse(data, GenerateContentRequest)
        return body, body.to_request(model)

    body, neutral = await state.offload.run(validate)
    lease, events = await state.dispatcher.open(neutral)
    formatter = GeminiFormatter(model, include_thoughts=body.include_thoughts)
    identify(events, formatter.id)
    headers = {"x-sluice-slot": slot_header(events.meta.slot, events.meta.replica)}

    async def fold() -> dict[str, Any]:
        async for event in events:
            if isinstance(event, ErrorEvent):
                raise as_sluice_error(event.error)
            formatter.frames(event)
        return formatter.response()

    sse = request.query_params.get("alt") == "sse"

    async def array() -> AsyncIterator[bytes]:
        """Without ``alt=sse``: one JSON array, a record at a time."""
        first = True
        async for frame in _records(events, formatter):
            yield (b"[" if first else b",\r\n") + orjson.dumps(frame)
            first = False
        yield b"[]" if first else b"]"

    return await respond(
        request,
        state.settings,
        stream=stream,
        frames=(lambda: sse_stream(events, formatter)) if sse else array,
        fold=fold,
        close=lambda: lease.close(events),
        headers=lambda: headers,
        render_error=error_response,
        ping=None,
        failure_frame=error_frame if sse else _array_failure,
        content_type="text/event-stream" if sse else "application/json",
    )


async def _records(events: Any, formatter: GeminiFormatter) -> AsyncIterator[Any]:
    async for event in events:
        if isinstance(event, ErrorEvent):
            for frame in formatter.error(event.error):
                yield frame.data
            return
        for frame in formatter.frames(event):
            yield frame.data


async def _passthrough(
    request: Request, state: ServerState, target: UpstreamTarget, method: str, data: Any
) -> Response:
    """A request to an upstream that speaks the Gemini API: the body as it came, to its
    own name for the model, with the query (``alt=sse``) but not a ``key`` (the slot's
    own key goes as ``x-goog-api-key``); its bytes back unchanged, a stream's as they
    come (SSE with ``alt=sse``, else one JSON array)."""
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "key"])
    path = f"/models/{quote(target.model, safe='/')}:{method}" + (f"?{query}" if query else "")
    raw = orjson.dumps(_renamed(data, f"models/{target.model}"))
    key = target.slot.spec.api_key
    headers = {"accept": request.headers.get("accept") or "*/*"}
    if key:
        headers["x-goog-api-key"] = key
    sse = request.query_params.get("alt") == "sse"
    answer = await state.dispatcher.passthrough(
        target,
        path,
        raw,
        headers,
        tap=GeminiRecordTap,
        prefix=PREFIX,
        conversation={**data, "model": target.model} if isinstance(data, dict) else None,
        session=request.headers,
        # A stream dropped mid-answer: continued through the slot's chat (SSE only).
        resumable=GeminiPartial if method == "streamGenerateContent" and sse else None,
    )
    return await forward(
        request,
        state.settings,
        answer,
        failure_frame=error_frame if sse else _array_failure,
        render_error=error_response,
        json_stream=method == "streamGenerateContent",
    )


def _renamed(data: Any, name: str) -> Any:
    """The body with the model named inside it (``countTokens``' ``generateContentRequest``,
    each of ``batchEmbedContents``' ``requests``) as the upstream's ``name``."""
    inner = [data.get("generateContentRequest")]
    requests = data.get("requests")
    if isinstance(requests, list):
        inner.extend(requests)
    for item in inner:
        if isinstance(item, dict) and "model" in item:
            item["model"] = name
    return data


def _array_failure(error: BaseException) -> bytes:
    return b",\r\n" + orjson.dumps(error_body(as_sluice_error(error))) + b"]"


async def _count_tokens(
    request: Request, state: ServerState, model: str, data: dict[str, Any]
) -> Response:
    def validate() -> Any:
        _check_limits(data.get("generateContentRequest") or data, state)
        return parse(data, CountTokensRequest).to_request(model)

    neutral = await state.offload.run(validate)
    count = await count_prompt(request, state, neutral)
    if count is None:
        return Response(status_code=CLIENT_GONE)
    return json_response({"totalTokens": count})


async def _embed(state: ServerState, model: str, requests: list[Any], *, batch: bool) -> Response:
    """``embedContent`` (one ``content``) and ``batchEmbedContents`` (``requests``, each
    with its ``content``): the text of each content's parts, embedded on ``model`` (cut
    to the model's embedding context, as Google's ``autoTruncate`` does)."""
    texts: list[str] = []
    dimensions: int | None = None
    for i, item in enumerate(requests):
        where = f"requests[{i}]" if batch else ""
        at = f"{where}.content" if where else "content"
        if not isinstance(item, dict) or not isinstance(item.get("content"), dict):
            raise InvalidRequest(f"'{at}' must be a Content object", param=at)
        parts = item["content"].get("parts")
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise InvalidRequest(f"'{at}.parts' must be text parts", param=f"{at}.parts")
        texts.append("\n".join(p["text"] for p in parts))
        wanted = item.get("outputDimensionality")
        if wanted is not None:
            if not isinstance(wanted, int) or wanted < 1:
                where_dim = f"{where}.outputDimensionality" if where else "outputDimensionality"
                raise InvalidRequest(
                    "'outputDimensionality' must be a positive integer", param=where_dim
                )
            dimensions = wanted
    inputs = check_embed_inputs(texts, state.limits)
    lease = await state.dispatcher.acquire(model)
    try:
        result = await lease.embed(inputs, truncate=True, dimensions=dimensions)
    finally:
        lease.release()
    if batch:
        return json_response({"embeddings": [{"values": v} for v in result.vectors]})
    return json_response({"embedding": {"values": result.vectors[0]}})


def _check_limits(data: Any, state: ServerState) -> None:
    """The body's counts within the server's limits (``contents`` as messages)."""
    if not isinstance(data, dict):
        return
    contents = data.get("contents")
    if isinstance(contents, list) and len(contents) > state.limits.max_messages:
        raise InvalidRequest(
            f"'contents' has {len(contents)} turns; the limit is {state.limits.max_messages} "
            "(--max-messages).",
            param="contents",
        )
    config = data.get("generationConfig")
    stops = config.get("stopSequences") if isinstance(config, dict) else None
    if stops is not None:
        check_body_limits({"stopSequences": stops}, state.limits, stop="stopSequences")


# -- models ------------------------------------------------------------------------------


def _entry(name: str, context: int | None, methods: tuple[str, ...]) -> dict[str, Any]:
    """Google's ``Model`` resource. It has no field for what a model takes in (every
    Gemini model sees): which models see is in ``/v1/info`` and the other lists."""
    return {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "001",
        "displayName": name,
        "description": f"{name}, served by sluice",
        # a window is shared by the prompt and the reply: either may take all of it
        "inputTokenLimit": context or 0,
        "outputTokenLimit": context or 0,
        "supportedGenerationMethods": list(methods),
    }


async def _catalog(state: ServerState, only: str | None = None) -> list[dict[str, Any]]:
    """Every model (``only``: that one), local ones with the window a load gives them
    (their file read off the loop), upstream ones with what their server says (0:
    unknown)."""
    specs = [s for s in state.dispatcher.known() if only in (None, s.name)]
    files = await state.offload.run(lambda: read_all_model_files(specs, state.settings))
    out = []
    for spec in specs:
        runner = getattr(state.registry.get_loaded(spec.name), "runner", None)
        loaded = getattr(runner, "n_ctx_seq", None)
        window = context_window(spec, state.settings, files[spec.name], loaded)
        out.append(_entry(spec.name, window, _METHODS))
    for public, slot, model in state.dispatcher.upstream_models():
        if only in (None, public):
            out.append(_entry(public, upstream_context(slot.entry(model)), _METHODS))
    return out


@errors_as(error_response)
async def list_models(request: Request) -> Response:
    return json_response({"models": await _catalog(server_state(request))})


@errors_as(error_response)
async def get_model(request: Request) -> Response:
    name = request.path_params["model"].removeprefix("models/")
    for entry in await _catalog(server_state(request), name):
        if entry["name"] == f"models/{name}":
            return json_response(entry)
    raise ModelNotFound(name)
