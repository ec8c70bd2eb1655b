"""Routes only: parse -> call one service -> pick the response."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sluice.api.body import read_body
from sluice.api.sse import SSEResponse, dumps, error_response, run_until_disconnect, sse_stream
from sluice.catalog import ModelSpec
from sluice.errors import InvalidRequest, ModelNotFound, ShuttingDown, SluiceError
from sluice.protocol.body import BodyLimits, check_body_limits, parse_json_body, paused_gc
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest
from sluice.serving.accumulate import Fold
from sluice.serving.formatters.openai import (
    ChatStreamFormatter,
    ResponseMeta,
    TextStreamFormatter,
    chat_completion_body,
    text_completion_body,
)
from sluice.serving.local import LocalModel
from sluice.serving.registry import ModelStatus
from sluice.serving.request import GenerationRequest

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
    request: GenerationRequest | None = None
    error: SluiceError | None = None


def _parse(
    raw: bytes, model: type[ChatCompletionRequest | CompletionRequest], limits: BodyLimits
) -> _Parsed:
    with paused_gc():
        data = parse_json_body(raw, limits)
        stream = data.get("stream") is True
        try:
            check_body_limits(data, limits)
            body = _validate(data, model)
            return _Parsed(stream, body=body, request=body.to_request())
        except SluiceError as exc:
            return _Parsed(stream, error=exc)
        finally:
            del data  # freed by reference counting while the collector is paused


async def _complete(
    request: Request, model: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    state = _state(request)
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
    if parsed.body is None or parsed.request is None:
        assert parsed.error is not None
        # A streaming call that asked for SSE gets its validation error as one
        # error frame too (spec 000: no role frame, the validation message).
        return error_response(parsed.error, sse=parsed.stream and _wants_sse(request))
    body, neutral = parsed.body, parsed.request
    chat = isinstance(body, ChatCompletionRequest)
    sse = body.stream and _wants_sse(request)
    try:
        # A model that is not loaded loads here (the stream waits for it), then the
        # request is validated against it: the role frame still comes only after.
        lease = await state.registry.acquire(neutral.model, ttl=body.ttl)
    except SluiceError as exc:
        return error_response(exc, sse=sse)
    try:
        stream = await lease.model.open(neutral)
    except SluiceError as exc:
        lease.release()
        # Knowable before the first byte: a real status, in the shape asked for.
        return error_response(exc, sse=sse)
    except BaseException:
        lease.release()
        raise
    meta = ResponseMeta.of(
        stream.meta,
        chat=chat,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )

    async def close() -> None:
        try:
            await stream.aclose()
        finally:
            lease.release()

    if body.stream:
        formatter = ChatStreamFormatter(meta) if chat else TextStreamFormatter(meta)
        return SSEResponse(  # type: ignore[return-value]
            sse_stream(stream, formatter),
            on_close=close,
            ping_interval=state.settings.ping_interval,
            stall_timeout=state.settings.stall_timeout,
        )

    async def fold() -> dict[str, Any]:
        acc = Fold(stream.meta.prompt_owners)
        async for event in stream:
            acc.add(event)
        render = chat_completion_body if chat else text_completion_body
        return render(meta, acc.result())

    try:
        result = await run_until_disconnect(request.receive, fold())
    finally:
        await close()
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    return _json(result)


def _model_entry(state: ServerState, spec: ModelSpec, status: ModelStatus) -> dict[str, Any]:
    """An OpenAI ``/v1/models`` entry, with the load state and (if loaded) its details."""
    entry: dict[str, Any] = {
        "id": status.name,
        "object": "model",
        "created": 0,
        "owned_by": "sluice",
        "status": status.state,
    }
    if spec.aliases:
        entry["aliases"] = list(spec.aliases)
    model = state.registry.get_loaded(status.name)
    if isinstance(model, LocalModel):
        entry["meta"] = model.card()
    return entry


def _models(state: ServerState) -> list[tuple[ModelSpec, ModelStatus]]:
    """Every known model: the default first (clients often take the first entry as
    "the" model), then the loaded ones, then the rest."""
    specs = {spec.name: spec for spec in state.registry.known()}
    default = state.registry.resolve(None).name
    listed = [(specs[s.name], s) for s in state.registry.status() if s.name in specs]
    return sorted(listed, key=lambda m: (m[0].name != default, m[1].state != "loaded"))


async def list_models(request: Request) -> Response:
    state = _state(request)
    data = [_model_entry(state, spec, status) for spec, status in _models(state)]
    return _json({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    state = _state(request)
    model_id = request.path_params["model_id"].lower()
    for spec, status in _models(state):
        if model_id in spec.lookup_keys():
            return _json(_model_entry(state, spec, status))
    raise ModelNotFound(request.path_params["model_id"])


async def health(request: Request) -> Response:
    state = _state(request)
    models: dict[str, Any] = {}
    for status in state.registry.status():
        entry: dict[str, Any] = {
            "status": status.state,
            "in_use": status.in_use,
            "loads": status.loads,
        }
        model = state.registry.get_loaded(status.name)
        if isinstance(model, LocalModel):
            entry.update(model.health())
        models[status.name] = entry
    default = state.registry.resolve(None).name
    body: dict[str, Any] = {"status": "ok", "model": default, "models": models}
    # The default model's figures at the top level, as before there were many models.
    for key in ("slots", "engine"):
        if key in models.get(default, {}):
            body[key] = models[default][key]
    return _json(body)
