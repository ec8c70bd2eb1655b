"""Routes only: parse -> call one service -> pick the response."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sluice.api.body import read_body
from sluice.api.sse import SSEResponse, dumps, error_response, run_until_disconnect, sse_stream
from sluice.errors import InvalidRequest, ModelNotFound, ShuttingDown, SluiceError
from sluice.protocol.body import BodyLimits, check_body_limits, parse_json_body, paused_gc
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest
from sluice.serving.accumulate import ResponseAccumulator
from sluice.serving.completions import Generation
from sluice.serving.formatters.openai import ChatStreamFormatter, TextStreamFormatter
from sluice.serving.stream import EventStream

if TYPE_CHECKING:
    from sluice.api.app import ServerState

log = logging.getLogger("sluice.api")

M = TypeVar("M", bound=BaseModel)


def _state(request: Request) -> ServerState:
    return request.app.state.sluice  # type: ignore[no-any-return]


def _json(data: Any, status: int = 200) -> Response:
    return Response(dumps(data), status, media_type="application/json")


def _validate(data: dict[str, Any], model: type[M]) -> M:
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = _field_path(first["loc"], data, missing=first["type"] == "missing")
        raise InvalidRequest(f"Invalid '{loc}': {first['msg']}", param=loc or None) from exc
    unknown = parsed.unknown_fields()  # type: ignore[attr-defined]
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown))
    return parsed


def _field_path(loc: tuple[int | str, ...], data: Any, *, missing: bool = False) -> str:
    """``messages[0].content`` from pydantic's location, without its union-member tags.

    Pydantic puts the member it tried into the location (``prompt.str``,
    ``content.list[ContentPart]``); a step that is not a key or index of the body
    there is such a tag, except the last step of a missing field.
    """
    path = ""
    node = data
    for i, step in enumerate(loc):
        if isinstance(step, int) and isinstance(node, list) and 0 <= step < len(node):
            node = node[step]
            path += f"[{step}]"
        elif (
            isinstance(step, str)
            and isinstance(node, dict)
            and (step in node or (missing and i == len(loc) - 1))
        ):
            node = node.get(step)
            path += f".{step}" if path else step
    return path


def _wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


async def chat_completions(request: Request) -> Response:
    return await _complete(request, ChatCompletionRequest)


async def completions(request: Request) -> Response:
    return await _complete(request, CompletionRequest)


@dataclass(slots=True)
class _Parsed:
    """A body read off the event loop: the request, or the error to answer with."""

    stream: bool  # the body asked for a stream (picks the error shape)
    body: ChatCompletionRequest | CompletionRequest | None = None
    error: SluiceError | None = None


def _parse(
    raw: bytes, model: type[ChatCompletionRequest | CompletionRequest], limits: BodyLimits
) -> _Parsed:
    with paused_gc():
        data = parse_json_body(raw, limits)
        stream = data.get("stream") is True
        try:
            check_body_limits(data, limits)
            return _Parsed(stream, body=_validate(data, model))
        except SluiceError as exc:
            return _Parsed(stream, error=exc)
        finally:
            del data  # freed by reference counting while the collector is paused


async def _complete(
    request: Request, model: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    state = _state(request)
    service = state.service
    try:
        raw = await read_body(request, state.settings.max_body_bytes)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        return Response(status_code=499)
    # Refused after the body is read: an unread body would reset the connection
    # under the 503 for a client that sent "Connection: close".
    if state.draining:
        raise ShuttingDown("The server is shutting down; no new requests are admitted.")
    # Parsing, templates, tokenization and grammars run on worker threads: one
    # heavy request must never stall other streams or /health.
    parsed = await state.offload.run(lambda: _parse(raw, model, state.limits))
    if parsed.body is None:
        assert parsed.error is not None
        # A streaming call that asked for SSE gets its validation error as one
        # error frame too (spec 000: no role frame, the validation message).
        return error_response(parsed.error, sse=parsed.stream and _wants_sse(request))
    body = parsed.body
    chat = isinstance(body, ChatCompletionRequest)
    loop = asyncio.get_running_loop()

    def prepare() -> tuple[Generation, EventStream]:
        gen = (
            service.prepare_chat(body)
            if isinstance(body, ChatCompletionRequest)
            else service.prepare_text(body)
        )
        return gen, service.open(gen, loop)

    try:
        gen, stream = await state.offload.run(prepare, on_abandon=lambda r: r[1].close())
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
                "paused": stats.paused,  # waiting for their client to read (backpressure)
            },
            "engine": {
                "steps": stats.steps,
                "tokens_generated": stats.tokens_generated,
                "prompt_tokens_processed": stats.prompt_tokens_processed,
                "cached_tokens_reused": stats.cached_tokens,
            },
        }
    )
