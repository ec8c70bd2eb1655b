"""The one SSE encoder, and the streaming response that owns a generation.

Example::

    return SSEResponse(sse_stream(events, formatter), on_close=stream.close)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sluice.errors import EngineFailure, SluiceError, error_body, error_frame_payload, spec_for
from sluice.events import ErrorEvent, Event
from sluice.serving.formatters.base import DONE, Frame

log = logging.getLogger("sluice.api")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
PING = b": ping\n\n"


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def encode(frame: Frame) -> bytes:
    data = frame.data if isinstance(frame.data, str) else dumps(frame.data)
    if frame.event is None:
        return f"data: {data}\n\n".encode()
    return f"event: {frame.event}\ndata: {data}\n\n".encode()


def as_sluice_error(error: BaseException) -> SluiceError:
    if isinstance(error, SluiceError):
        return error
    return EngineFailure(f"{type(error).__name__}: {error}")


def error_frame(error: BaseException) -> bytes:
    return encode(Frame(error_frame_payload(as_sluice_error(error)), event="error"))


def error_response(error: SluiceError, *, sse: bool = False) -> Response:
    """A pre-stream error: real status; OpenAI JSON, or one SSE error frame if asked."""
    spec = spec_for(error)
    headers = error.headers()
    if sse:
        return Response(error_frame(error), spec.status, headers, media_type="text/event-stream")
    return Response(dumps(error_body(error)), spec.status, headers, media_type="application/json")


class StreamFormatter(Protocol):
    def frames(self, event: Event) -> list[Frame]: ...

    def end(self) -> list[Frame]: ...


async def sse_stream(
    events: AsyncIterator[Event], formatter: StreamFormatter, *, done: bool = True
) -> AsyncIterator[bytes]:
    """Events -> encoded frames; an error event ends the stream with an error frame."""
    async for event in events:
        if isinstance(event, ErrorEvent):
            yield error_frame(event.error)
            return
        for frame in formatter.frames(event):
            yield encode(frame)
    for frame in formatter.end():
        yield encode(frame)
    if done:
        yield encode(DONE)


class SSEResponse:
    """An ASGI response that streams frames and watches the client.

    Headers go out at once; a ``: ping`` comment is sent after
    ``ping_interval`` seconds of silence (long queue waits, long prefills);
    when the client disconnects the producer is cancelled and ``on_close``
    runs at once, so the engine frees the slot within one step.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        on_close: Callable[[], None],
        ping_interval: float = 10.0,
        stall_timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body = body
        self.on_close = on_close
        self.ping_interval = ping_interval
        self.stall_timeout = stall_timeout  # a write the client does not take within this
        self.headers = SSE_HEADERS + [
            (k.lower().encode(), v.encode()) for k, v in (headers or {}).items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        lock = asyncio.Lock()
        last_sent = loop.time()

        async def emit(chunk: bytes) -> None:
            nonlocal last_sent
            async with lock:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last_sent = loop.time()

        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            try:
                async for chunk in self.body:
                    await emit(chunk)
            except Exception as exc:  # a bug below: end the stream visibly, not silently
                log.exception("stream producer failed")
                await emit(error_frame(exc))
            async with lock:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def ping() -> None:
            # A separate timer, so the per-chunk path stays one plain await.
            while True:
                await asyncio.sleep(max(0.0, last_sent + self.ping_interval - loop.time()))
                if loop.time() - last_sent >= self.ping_interval:
                    await emit(PING)

        producer = asyncio.ensure_future(produce())
        others = [asyncio.ensure_future(_wait_disconnect(receive)), asyncio.ensure_future(ping())]
        try:
            await asyncio.wait({producer, others[0]}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, *others):
                task.cancel()
            await asyncio.gather(producer, *others, return_exceptions=True)
            self.on_close()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Any) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it).

    For non-streaming responses: the generation is aborted as soon as the
    client goes away, not when the answer is finally ready. Returns None on
    disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        return None
    if not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()
