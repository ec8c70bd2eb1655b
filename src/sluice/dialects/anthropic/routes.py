"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Order of a request:

1. Before any byte (a real HTTP status, Anthropic's error body): the body is read
   within the size limit and parsed; a model of an upstream that speaks Messages
   itself (``native_apis = ["anthropic"]``) gets the body as it came, only
   ``model`` rewritten, and its answer's bytes go back unchanged. Otherwise the
   body is validated and becomes the neutral request (``schema.py``); images for a
   local model (which has no vision) are a 400; the slot is acquired (a local
   model loads just in time) and the request opened on it: a prompt over the
   context is a 400 "prompt is too long" here.
2. The events become Anthropic's named events (``format.py``), or fold into the
   message; ``ping`` events keep a quiet stream alive. A failure after the start
   is an ``event: error`` frame.

Both API-key headers are accepted (``x-api-key`` and ``Authorization: Bearer``,
``server/auth.py``); ``anthropic-version`` and ``anthropic-beta`` are read by
nobody: every version and beta flag is accepted, as are ``?beta=true`` URLs.

Example::

    curl localhost:8080/v1/messages -H 'x-api-key: KEY' -d '{"model": "smollm2",
      "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], "stream": true}'
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from sluice.core.errors import as_sluice_error
from sluice.core.events import ErrorEvent
from sluice.core.request import GenerationRequest
from sluice.dialects.anthropic.format import (
    PING,
    MessagesFormatter,
    error_frame,
    error_response,
)
from sluice.dialects.anthropic.schema import CountTokensRequest, MessagesRequest, parse
from sluice.metrics import AnthropicEventTap
from sluice.models.dispatch import UpstreamTarget
from sluice.models.flights import identify
from sluice.server.jsonbody import check_body_limits
from sluice.server.respond import CLIENT_GONE, count_prompt, errors_as, forward, respond
from sluice.server.sse import json_response, sse_stream
from sluice.server.state import ServerState, read_json, server_state
from sluice.upstream.backend import slot_header

log = logging.getLogger("sluice.api")

W = TypeVar("W", MessagesRequest, CountTokensRequest)

NATIVE = "anthropic"  # an upstream's native_apis entry for this dialect
# Request headers a native upstream needs from the client (auth is the slot's own).
_FORWARDED = ("anthropic-version", "anthropic-beta", "accept")


def _native(state: ServerState, data: dict[str, Any]) -> UpstreamTarget | None:
    """The upstream target when the model's slot speaks Messages itself."""
    return state.dispatcher.native(data.get("model"), NATIVE)


async def _read(
    request: Request, wire: type[W], upstream_path: str
) -> Response | tuple[W, GenerationRequest]:
    """The body as ``wire`` and its neutral request, or the answer already: a native
    upstream's (passed through to ``upstream_path``), or nobody's (the client left)."""
    state = server_state(request)
    data = await read_json(request)
    if data is None:
        return Response(status_code=CLIENT_GONE)
    target = _native(state, data)
    if target is not None:
        return await _passthrough(request, target, data, upstream_path)

    def validate() -> tuple[W, GenerationRequest]:
        check_body_limits(data, state.limits, stop="stop_sequences")
        body = parse(data, wire)
        return body, body.to_request()

    body, neutral = await state.offload.run(validate)
    return body, neutral


@errors_as(error_response)
async def messages(request: Request) -> Response:
    read = await _read(request, MessagesRequest, "/messages")
    if not isinstance(read, tuple):  # (an SSEResponse is not a starlette Response)
        return read
    body, neutral = read
    state = server_state(request)
    lease, stream = await state.dispatcher.open(neutral)
    formatter = MessagesFormatter(model=body.model, max_tokens=body.max_tokens)
    identify(stream, formatter.id)
    headers = {"x-sluice-slot": slot_header(stream.meta.slot, stream.meta.replica)}

    async def fold() -> dict[str, Any]:
        async for event in stream:
            if isinstance(event, ErrorEvent):
                raise as_sluice_error(event.error)
            formatter.frames(event)
        formatter.end()
        return formatter.message()

    return await respond(
        request,
        state.settings,
        stream=body.stream,
        frames=lambda: sse_stream(stream, formatter),
        fold=fold,
        close=lambda: lease.close(stream),
        headers=lambda: headers,
        render_error=error_response,
        ping=PING,
        failure_frame=error_frame,
    )


@errors_as(error_response)
async def count_tokens(request: Request) -> Response:
    read = await _read(request, CountTokensRequest, "/messages/count_tokens")
    if not isinstance(read, tuple):  # (an SSEResponse is not a starlette Response)
        return read
    _body, neutral = read
    state = server_state(request)
    count = await count_prompt(request, state, neutral)
    if count is None:
        return Response(status_code=CLIENT_GONE)
    return json_response({"input_tokens": count})


async def _passthrough(
    request: Request, target: UpstreamTarget, data: dict[str, Any], path: str
) -> Response:
    """A Messages request to an upstream that speaks Messages: its bytes, unchanged (a
    stream the upstream drops mid-answer is continued by another replica: failover)."""
    state = server_state(request)
    data["model"] = target.model
    raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    headers = {k: v for k in _FORWARDED if (v := request.headers.get(k)) is not None}
    answer = await state.dispatcher.passthrough(
        target,
        path,
        raw,
        headers,
        tap=AnthropicEventTap,
        conversation=data,
        session=request.headers,
        # A stream another replica may continue if this one drops it (failover).
        resume=path == "/messages" and data.get("stream") is True,
    )
    return await forward(
        request, state.settings, answer, failure_frame=error_frame, render_error=error_response
    )
