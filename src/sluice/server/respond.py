"""Answer a request from its event stream: stream it as SSE, or fold it into one JSON body.

Every dialect's route ends here, so streaming and non-streaming are one code path
to the point where the bytes go out: the stream is closed (the generation aborted,
the slot released, the turn stored) exactly once, whether the answer completed,
the client went away, or it failed.

Example::

    return await respond(
        raw_request, settings,
        stream=body.stream,
        frames=lambda: sse_stream(stream, formatter),
        fold=fold_into_body,
        close=stream_and_lease_close,
        headers=lambda: {"x-sluice-slot": slot},
    )
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, cast

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sluice.config import Settings
from sluice.core.errors import InternalError, SluiceError
from sluice.server.sse import (
    PING,
    SSE_HEADERS,
    Relayed,
    RelayResponse,
    SSEResponse,
    error_frame,
    error_response,
    json_response,
    run_until_disconnect,
)

log = logging.getLogger("sluice.api")

CLIENT_GONE = 499  # nginx's status for a client that closed the connection first

Handler = Callable[[Request], Awaitable[Response]]


def errors_as(render: Callable[[SluiceError], Response]) -> Callable[[Handler], Handler]:
    """A route decorator: every error of the route answered by ``render`` (the
    dialect's shape; the app's handlers would write OpenAI's), an unexpected one
    as an :class:`InternalError`, a client gone before its body arrived as a 499.

    Example::

        @errors_as(anthropic_error_response)
        async def messages(request: Request) -> Response: ...
    """

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except SluiceError as exc:
                return render(exc)
            except ClientDisconnect:  # gone before its body arrived: nobody to answer
                return Response(status_code=CLIENT_GONE)
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.url.path)
                return render(InternalError(f"Internal error: {type(exc).__name__}"))

        return route

    return decorate


def _no_headers() -> Mapping[str, str]:
    return {}


async def respond(
    raw_request: Request,
    settings: Settings,
    *,
    stream: bool,
    frames: Callable[[], AsyncIterator[bytes]],
    fold: Callable[[], Awaitable[Any]],
    close: Callable[[], Awaitable[None]],
    headers: Callable[[], Mapping[str, str]] = _no_headers,
    render_error: Callable[[SluiceError], Response] = error_response,
    error_headers: Mapping[str, str] | None = None,
    ping: bytes | None = PING,
    failure_frame: Callable[[BaseException], bytes] = error_frame,
    content_type: str = "text/event-stream",
) -> Response:
    """``frames()`` as an SSE response when ``stream``, else ``fold()``'s JSON body.

    ``close`` runs once: when the SSE response ends (or its client goes away), or
    after the fold, before the answer is sent (a stored turn is durable by then).
    A fold that raises or returns a :class:`SluiceError` answers with
    ``render_error`` (the dialect's error shape) and ``error_headers``; a client
    that went away during the fold gets a bare 499 nobody reads. ``headers`` is
    asked once the answer is known (the slot that served it, say). ``ping`` is the
    stream's keep-alive (None: a stream format without one, like NDJSON) and
    ``failure_frame`` the frame for a failure no formatter saw, both in the dialect's
    shape; ``content_type`` the stream's (Ollama's is ``application/x-ndjson``).
    """
    if stream:
        return SSEResponse(  # type: ignore[return-value]
            frames(),
            on_close=close,
            ping_interval=settings.ping_interval if ping is not None else 0.0,
            stall_timeout=settings.stall_timeout,
            headers=dict(headers()),
            base_headers=[
                (b"content-type", content_type.encode()),
                *(h for h in SSE_HEADERS if h[0] != b"content-type"),
            ],
            ping=ping or b"",
            failure_frame=failure_frame,
        )
    try:
        result = await run_until_disconnect(raw_request.receive, fold())
    except SluiceError as exc:
        result = exc
    finally:
        await close()
    if result is None:
        return Response(status_code=CLIENT_GONE)
    if isinstance(result, SluiceError):
        response = render_error(result)
        response.headers.update(error_headers or {})
        return response
    response = json_response(result)
    response.headers.update(headers())
    return response


class Forwarded(Protocol):
    """An upstream's answer being forwarded unchanged (``upstream.backend.Passthrough``)."""

    @property
    def status(self) -> int: ...

    @property
    def streaming(self) -> bool: ...

    def headers(self) -> dict[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...

    def stream_array(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


async def forward(
    raw_request: Request,
    settings: Settings,
    answer: Forwarded,
    *,
    failure_frame: Callable[[BaseException], bytes],
    render_error: Callable[[SluiceError], Response],
    json_stream: bool = False,
) -> Response:
    """An upstream's answer in its own dialect, byte for byte: its SSE events as they
    come (a failure after the first byte ends them with ``failure_frame``), or its
    whole body with its status; ``render_error`` answers a failure before that.
    ``json_stream``: a successful JSON body is a stream too (Gemini's JSON array), its
    bytes forwarded as they come."""
    as_array = json_stream and answer.status == 200 and not answer.streaming
    if answer.streaming or as_array:
        streamed = SSEResponse(
            # A failure after the first byte ends the stream with the dialect's frame.
            answer.stream_array() if as_array else answer.stream(),
            on_close=answer.close,
            failure_frame=failure_frame,
            ping_interval=0,  # the bytes are the upstream's: no pings of ours in them
            stall_timeout=settings.stall_timeout,
            headers=answer.headers(),
            base_headers=[(b"x-accel-buffering", b"no")],
        )
        if as_array or not getattr(answer, "relayable", False):
            return streamed  # type: ignore[return-value]
        # SSE events straight from the upstream's socket to the client's (uvicorn).
        return RelayResponse(  # type: ignore[return-value]
            cast(Relayed, answer),
            streamed,
            on_close=answer.close,
            stall_timeout=settings.stall_timeout,
            headers=streamed.headers,
            failure_frame=failure_frame,
        )
    try:
        body = await run_until_disconnect(raw_request.receive, answer.read())
    except SluiceError as exc:  # the upstream failed while sending its answer
        return render_error(exc)
    finally:
        answer.close()
    if body is None:
        return Response(status_code=CLIENT_GONE)
    return Response(body, answer.status, answer.headers())


async def count_prompt(raw_request: Request, state: Any, request: Any) -> int | None:
    """The tokens of ``request``'s prompt on its model's slot (a local model loads just in
    time); None if the client went away meanwhile."""
    lease = await state.dispatcher.acquire(request.model)
    try:
        count: int | None = await run_until_disconnect(
            raw_request.receive, lease.count_prompt_tokens(request)
        )
    finally:
        lease.release()
    return count
