"""Routes only: parse -> call one service -> pick the response."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from sluice.api.body import read_body
from sluice.api.sse import SSEResponse, dumps, error_response, run_until_disconnect, sse_stream
from sluice.errors import InvalidRequest, ModelNotFound, ShuttingDown, SluiceError
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest
from sluice.serving.accumulate import ResponseAccumulator
from sluice.serving.completions import Generation
from sluice.serving.formatters.openai import ChatStreamFormatter, TextStreamFormatter

if TYPE_CHECKING:
    from sluice.api.app import ServerState

log = logging.getLogger("sluice.api")

M = TypeVar("M", bound=BaseModel)


def _state(request: Request) -> ServerState:
    return request.app.state.sluice  # type: ignore[no-any-return]


def _json(data: Any, status: int = 200) -> Response:
    return Response(dumps(data), status, media_type="application/json")


async def _read_json(request: Request) -> dict[str, Any]:
    raw = await read_body(request, _state(request).settings.max_body_bytes)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("The body must be a JSON object.")
    return data


def _validate(data: dict[str, Any], model: type[M]) -> M:
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"Invalid '{loc}': {first['msg']}", param=loc or None) from exc
    unknown = parsed.unknown_fields()  # type: ignore[attr-defined]
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown))
    return parsed


def _wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


async def chat_completions(request: Request) -> Response:
    return await _complete(request, ChatCompletionRequest)


async def completions(request: Request) -> Response:
    return await _complete(request, CompletionRequest)


async def _complete(
    request: Request, model: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    state = _state(request)
    if state.draining:
        raise ShuttingDown("The server is shutting down; no new requests are admitted.")
    service = state.service
    data = await _read_json(request)
    try:
        body = _validate(data, model)
    except SluiceError as exc:
        # A streaming call that asked for SSE gets its validation error as one
        # error frame too (spec 000: no role frame, the validation message).
        return error_response(exc, sse=data.get("stream") is True and _wants_sse(request))
    chat = isinstance(body, ChatCompletionRequest)
    try:
        gen: Generation = (
            service.prepare_chat(body)
            if isinstance(body, ChatCompletionRequest)
            else service.prepare_text(body)
        )
        stream = service.open(gen)
    except SluiceError as exc:
        # Knowable before the first byte: a real status, in the shape asked for.
        return error_response(exc, sse=body.stream and _wants_sse(request))
    if body.stream:
        formatter = ChatStreamFormatter(gen.meta) if chat else TextStreamFormatter(gen.meta)
        return SSEResponse(  # type: ignore[return-value]
            sse_stream(service.events(gen, stream), formatter),
            on_close=stream.close,
            ping_interval=state.settings.ping_interval,
            stall_timeout=state.settings.stall_timeout,
        )

    async def fold() -> dict[str, Any]:
        acc = ResponseAccumulator(gen.meta)
        async for event in service.events(gen, stream):
            acc.add(event)
        return acc.chat_completion() if chat else acc.text_completion()

    try:
        result = await run_until_disconnect(request.receive, fold())
    finally:
        stream.close()
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    return _json(result)


async def list_models(request: Request) -> Response:
    card = _state(request).service.model_card()
    return _json({"object": "list", "data": [card]})


async def get_model(request: Request) -> Response:
    service = _state(request).service
    model_id = request.path_params["model_id"]
    if model_id != service.model_id:
        raise ModelNotFound(model_id)
    return _json(service.model_card())


async def health(request: Request) -> Response:
    state = _state(request)
    stats = state.engine.stats
    return _json(
        {
            "status": "ok",
            "model": state.service.model_id,
            "slots": {
                "total": stats.slots,
                "active": stats.active,
                "queued": stats.queued,
                "prefilling": stats.prefilling,
                "generating": stats.generating,
                "idle": stats.idle,
            },
            "engine": {
                "steps": stats.steps,
                "tokens_generated": stats.tokens_generated,
                "prompt_tokens_processed": stats.prompt_tokens_processed,
                "cached_tokens_reused": stats.cached_tokens,
            },
        }
    )
