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

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sluice.config import Settings
from sluice.core.errors import SluiceError
from sluice.server.sse import SSEResponse, error_response, json_response, run_until_disconnect

CLIENT_GONE = 499  # nginx's status for a client that closed the connection first


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
) -> Response:
    """``frames()`` as an SSE response when ``stream``, else ``fold()``'s JSON body.

    ``close`` runs once: when the SSE response ends (or its client goes away), or
    after the fold, before the answer is sent (a stored turn is durable by then).
    A fold that raises or returns a :class:`SluiceError` answers with
    ``render_error`` (the dialect's error shape) and ``error_headers``; a client
    that went away during the fold gets a bare 499 nobody reads. ``headers`` is
    asked once the answer is known (the slot that served it, say).
    """
    if stream:
        return SSEResponse(  # type: ignore[return-value]
            frames(),
            on_close=close,
            ping_interval=settings.ping_interval,
            stall_timeout=settings.stall_timeout,
            headers=dict(headers()),
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
