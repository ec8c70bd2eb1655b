"""Routes only: parse -> call one service -> pick the response."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import ModelNotFound, SluiceError
from sluice.core.fold import Fold
from sluice.core.model import ModelSpec
from sluice.core.request import GenerationRequest
from sluice.dialects.openai.format import (
    ChatStreamFormatter,
    ResponseMeta,
    TextStreamFormatter,
    chat_completion_body,
    text_completion_body,
)
from sluice.dialects.openai.schema import ChatCompletionRequest, CompletionRequest
from sluice.local.model import LocalModel
from sluice.models import catalog
from sluice.models.dispatch import UpstreamTarget
from sluice.models.entries import ModelStatus
from sluice.models.flights import identify
from sluice.models.gguf import projector_inputs
from sluice.server.body import read_request_body
from sluice.server.jsonbody import (
    BodyLimits,
    check_body_limits,
    parse_json_body,
    paused_gc,
    validate_body,
)
from sluice.server.respond import forward, respond
from sluice.server.sse import (
    error_frame,
    error_response,
    json_response,
    sse_stream,
    wants_sse,
)
from sluice.server.state import ServerState, server_state
from sluice.upstream.backend import slot_header, upstream_context

log = logging.getLogger("sluice.api")


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
    # An upstream model's request: the body to forward, only ``model`` rewritten.
    upstream: UpstreamTarget | None = None
    forward: bytes = b""
    conversation: dict[str, Any] | None = None  # the forwarded body, parsed (cache affinity)


Router = Callable[[str | None], UpstreamTarget | None]


# Bodies up to this size have their route decided on the event loop when upstreams
# are configured: parsing one takes tens of microseconds, less than the hop to a
# worker thread and back, and that hop is most of what a passthrough adds to the time
# to first token on a busy machine.
INLINE_ROUTE_BYTES = 32 * 1024


def _route(data: dict[str, Any], raw: bytes, route: Router) -> _Parsed | None:
    """An upstream model's request, ready to forward; None when a local model answers."""
    name = data.get("model")
    target = route(name) if isinstance(name, str) else None
    if target is None:
        return None
    # Validation is the upstream's: it may take fields sluice does not know.
    if name != target.model:  # an alias: the upstream gets its own name
        data["model"] = target.model
        raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    return _Parsed(data.get("stream") is True, upstream=target, forward=raw, conversation=data)


def _parse(
    raw: bytes,
    model: type[ChatCompletionRequest | CompletionRequest],
    limits: BodyLimits,
    route: Router,
) -> _Parsed:
    with paused_gc():
        data = parse_json_body(raw, limits)
        upstream = _route(data, raw, route)
        if upstream is not None:
            return upstream
        stream = data.get("stream") is True
        try:
            check_body_limits(data, limits)
            body = validate_body(data, model)
            return _Parsed(stream, body=body, request=body.to_request())
        except SluiceError as exc:
            return _Parsed(stream, error=exc)
        finally:
            del data  # freed by reference counting while the collector is paused


async def _complete(
    request: Request, model: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    state = server_state(request)
    raw = await read_request_body(request, state.settings.max_body_bytes, lambda: state.draining)
    if raw is None:
        return Response(status_code=499)
    # Parsing, templates, tokenization and grammars run on worker threads: one
    # heavy request must never stall other streams or /health.
    route = state.dispatcher.upstream
    parsed: _Parsed | None = None
    if state.dispatcher.upstreams and len(raw) <= INLINE_ROUTE_BYTES:
        parsed = _route(parse_json_body(raw, state.limits), raw, route)
    if parsed is None:
        parsed = await state.offload.run(lambda: _parse(raw, model, state.limits, route))
    if parsed.upstream is not None:
        path = "/chat/completions" if model is ChatCompletionRequest else "/completions"
        return await _passthrough(request, parsed, parsed.upstream, path)
    if parsed.body is None or parsed.request is None:
        assert parsed.error is not None
        # A streaming call that asked for SSE gets its validation error as one
        # error frame too (llama.cpp's server does so: no role frame, the validation message).
        return error_response(parsed.error, sse=parsed.stream and wants_sse(request))
    body, neutral = parsed.body, parsed.request
    chat = isinstance(body, ChatCompletionRequest)
    sse = body.stream and wants_sse(request)
    try:
        # A model that is not loaded loads here (the stream waits for it), then the
        # request is validated against it: the role frame still comes only after.
        lease, stream = await state.dispatcher.open(neutral, ttl=body.ttl)
    except SluiceError as exc:
        # Knowable before the first byte: a real status, in the shape asked for.
        return error_response(exc, sse=sse)
    meta = ResponseMeta.of(
        stream.meta,
        chat=chat,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )
    identify(stream, meta.id)
    headers = {"x-sluice-slot": slot_header(stream.meta.slot, stream.meta.replica)}

    async def fold() -> dict[str, Any]:
        acc = Fold(stream.meta.prompt_owners)
        async for event in stream:
            acc.add(event)
        render = chat_completion_body if chat else text_completion_body
        return render(meta, acc.result())

    formatter = ChatStreamFormatter(meta) if chat else TextStreamFormatter(meta)
    return await respond(
        request,
        state.settings,
        stream=body.stream,
        frames=lambda: sse_stream(stream, formatter),
        fold=fold,
        close=lambda: lease.close(stream),
        headers=lambda: headers,
    )


async def _passthrough(
    request: Request, parsed: _Parsed, target: UpstreamTarget, path: str
) -> Response:
    """An OpenAI request to an upstream model: its answer's bytes, unchanged."""
    state = server_state(request)
    accept = request.headers.get("accept")
    try:
        answer = await state.dispatcher.passthrough(
            target,
            path,
            parsed.forward,
            {"accept": accept} if accept else None,
            conversation=parsed.conversation,
            session=request.headers,
            resume=parsed.stream,
        )
    except SluiceError as exc:  # no replica answered: 502, or 503 when all are down
        return error_response(exc, sse=parsed.stream and wants_sse(request))
    return await forward(
        request, state.settings, answer, failure_frame=error_frame, render_error=error_response
    )


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
    projector = catalog.projector_of(spec, state.settings) if spec.replay is None else None
    if projector is not None:  # what it takes besides text (its header, read once)
        entry["modalities"] = {"input": ["text", *projector_inputs(projector)], "output": ["text"]}
    model = state.registry.get_loaded(status.name)
    if isinstance(model, LocalModel):
        entry["meta"] = model.card()
    return entry


def _models(state: ServerState) -> list[tuple[ModelSpec, ModelStatus]]:
    """Every known model: the default first (clients often take the first entry as
    "the" model), then the loaded ones, then the rest."""
    specs = {spec.name: spec for spec in state.dispatcher.known()}
    default = state.registry.resolve(None).name
    listed = [(specs[s.name], s) for s in state.registry.status() if s.name in specs]
    return sorted(listed, key=lambda m: (m[0].name != default, m[1].state != "loaded"))


def _upstream_entries(state: ServerState) -> list[tuple[list[str], dict[str, Any]]]:
    """Every upstream model's ``/v1/models`` entry, with the names it answers to."""
    out = []
    for public, slot, model in state.dispatcher.upstream_models():
        aliases = [a for a in slot.aliases_of(model) if a != public]
        entry: dict[str, Any] = {
            "id": public,
            "object": "model",
            "created": 0,
            "owned_by": slot.name,
            "status": slot.pool.state(),
        }
        if aliases:
            entry["aliases"] = aliases
        window = upstream_context(slot.entry(model))
        if window is not None:
            entry["meta"] = {"n_ctx": window}
        out.append(([k.lower() for k in (public, *aliases)], entry))
    return out


async def list_models(request: Request) -> Response:
    state = server_state(request)
    data = [_model_entry(state, spec, status) for spec, status in _models(state)]
    data += [entry for _, entry in _upstream_entries(state)]
    return json_response({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    state = server_state(request)
    model_id = request.path_params["model_id"].lower()
    for spec, status in _models(state):
        if model_id in spec.lookup_keys():
            return json_response(_model_entry(state, spec, status))
    for keys, entry in _upstream_entries(state):
        if model_id in keys:
            return json_response(entry)
    raise ModelNotFound(request.path_params["model_id"])
