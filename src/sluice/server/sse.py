"""The one SSE encoder, and the streaming response that owns a generation.

Example::

    return SSEResponse(sse_stream(events, formatter), on_close=stream.close)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sluice.core.errors import (
    SluiceError,
    as_sluice_error,
    error_body,
    error_frame_payload,
    spec_for,
)
from sluice.core.events import ErrorEvent, Event
from sluice.core.frames import Frame

log = logging.getLogger("sluice.api")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
PING = b": ping\n\n"


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def json_response(data: Any, status: int = 200) -> Response:
    """A JSON body encoded as every route encodes it (non-ASCII kept, compact), through
    orjson: numpy arrays too (float32 values in their shortest form: 64 embeddings of
    576 values took 16 ms and 794 kB with the stdlib, 1 ms and 434 kB this way)."""
    try:
        body = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:  # a lone surrogate, an integer past 64 bits
        body = _ascii_dumps(data).encode()
    return Response(body, status, media_type="application/json")


def encode(frame: Frame) -> bytes:
    """One SSE frame. JSON through orjson: every streamed token is one of these, and the
    stdlib's ``json.dumps`` with options builds a new encoder per call (measured: the
    event loop's CPU per streamed token 36.9 -> 30.6 us). Non-finite floats come out as
    ``null`` (the stdlib wrote ``-Infinity``, which is not JSON)."""
    if isinstance(frame.data, str):
        data = frame.data.encode()
    elif frame.ascii:
        data = _ascii_dumps(frame.data).encode()
    else:
        try:
            data = orjson.dumps(frame.data)
        except orjson.JSONEncodeError:  # a lone surrogate (from the client's JSON): escaped
            data = _ascii_dumps(frame.data).encode()
    if frame.event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + frame.event.encode() + b"\ndata: " + data + b"\n\n"


def _ascii_dumps(data: Any) -> str:
    # Error messages may quote the client's input, lone surrogates included: escaped
    # as \uXXXX they are still valid JSON, where raw they could not even be encoded.
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


def error_frame(error: BaseException) -> bytes:
    payload = _ascii_dumps(error_frame_payload(as_sluice_error(error)))
    return f"event: error\ndata: {payload}\n\n".encode()


def error_response(error: SluiceError, *, sse: bool = False) -> Response:
    """A pre-stream error: real status; OpenAI JSON, or one SSE error frame if asked."""
    spec = spec_for(error)
    headers = error.headers()
    if sse:
        return Response(error_frame(error), spec.status, headers, media_type="text/event-stream")
    return Response(
        _ascii_dumps(error_body(error)), spec.status, headers, media_type="application/json"
    )


class StreamFormatter(Protocol):
    """A dialect's frames: it owns its start, error and terminal frames."""

    def frames(self, event: Event) -> list[Frame]: ...

    def error(self, error: BaseException) -> list[Frame]: ...

    def end(self) -> list[Frame]: ...


async def sse_stream(
    events: AsyncIterable[Event], formatter: StreamFormatter
) -> AsyncIterator[bytes]:
    """Events -> encoded frames; an error event ends the stream with the dialect's error."""
    async for event in events:
        if isinstance(event, ErrorEvent):
            for frame in formatter.error(event.error):
                yield encode(frame)
            return
        for frame in formatter.frames(event):
            yield encode(frame)
    for frame in formatter.end():
        yield encode(frame)


RAW_SEND = "sluice.raw_send"  # the scope key of the server's own ``send``


class RawSend:
    """The outermost ASGI layer: puts the server's own ``send`` in the scope, for
    :class:`SSEResponse` to write a stream's chunks with once its start has gone
    through every middleware."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class SSEResponse:
    """An ASGI response that streams frames and watches the client.

    Headers go out at once; a ``: ping`` comment is sent after
    ``ping_interval`` seconds of silence (long queue waits, long prefills);
    when the client disconnects the producer is cancelled and ``on_close``
    runs at once, so the engine frees the slot within one step.

    A client that stops reading: the server's ``send`` blocks once the
    socket's buffers are full, so the producer stops taking events and the
    engine pauses the generation (``EngineConfig.stream_buffer``). A ``send``
    still blocked after ``stall_timeout`` seconds (``<= 0``: never) ends the
    response as a disconnect would, and drops the connection.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None] | None],
        ping_interval: float = 10.0,
        stall_timeout: float = 60.0,
        headers: dict[str, str] | None = None,
        base_headers: list[tuple[bytes, bytes]] | None = None,
        ping: bytes = PING,
        failure_frame: Callable[[BaseException], bytes] = error_frame,
    ) -> None:
        self.body = body
        self.ping = ping  # the dialect's keep-alive (Anthropic's is an event: ping)
        self.failure_frame = failure_frame  # a bug below the formatter, in the dialect's shape
        self.on_close = on_close
        self.ping_interval = ping_interval  # <= 0: never (a passthrough's bytes are not ours)
        self.stall_timeout = stall_timeout  # a write the client does not take within this
        self.headers = (SSE_HEADERS if base_headers is None else base_headers) + [
            (k.lower().encode(), v.encode()) for k, v in (headers or {}).items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        # The body's chunks go to the server's own send (see :class:`RawSend`): the
        # middlewares' wrappers only watch for the start, and passing each chunk
        # through four of them was a tenth of a gateway's CPU per event.
        body_send: Send = scope.get(RAW_SEND, send)
        # When the last send began, and whether it is still blocked: one clock
        # read per chunk serves both the ping timer and the stall watch.
        last_sent = loop.time()
        sending = False
        # Pings are the only other writer: without them a chunk's send needs no lock
        # (a gateway's passthrough, where every cost per chunk counts).
        lock = asyncio.Lock() if self.ping_interval > 0 else None

        async def emit(chunk: bytes, more_body: bool = True) -> None:
            nonlocal last_sent, sending
            if lock is not None:
                async with lock:
                    await emit_now(chunk, more_body)
            else:
                await emit_now(chunk, more_body)

        async def emit_now(chunk: bytes, more_body: bool) -> None:
            nonlocal last_sent, sending
            last_sent = loop.time()
            sending = True
            await body_send({"type": "http.response.body", "body": chunk, "more_body": more_body})
            sending = False

        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            try:
                async for chunk in self.body:
                    await emit(chunk)
            except SluiceError as exc:  # a failure after the first byte: its frame ends it
                await emit(self.failure_frame(exc))
            except Exception as exc:  # a bug below: end the stream visibly, not silently
                log.exception("stream producer failed")
                await emit(self.failure_frame(exc))
            await emit(b"", more_body=False)

        async def ping() -> None:
            # A separate timer, so the per-chunk path stays one plain await.
            while True:
                # (A blocked send is not silence: the client is not taking it.)
                wait = (
                    self.ping_interval if sending else last_sent + self.ping_interval - loop.time()
                )
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    await emit(self.ping)

        stalled = False
        stall_timer: asyncio.TimerHandle | None = None

        def watch_stall() -> None:
            """A timer: once per ``stall_timeout`` while all is well; a send blocked that
            long ends the response."""
            nonlocal stalled, stall_timer
            wait = (
                self.stall_timeout if not sending else last_sent + self.stall_timeout - loop.time()
            )
            if wait > 0:
                stall_timer = loop.call_later(wait, watch_stall)
            else:
                stalled = True
                producer.cancel()

        # The producer runs as a task of its own, which the client's disconnect, a stall
        # or pings can end or interleave with; this task waits for it. Nothing here
        # wakes per chunk.
        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(lambda _: producer.cancel())
        pinger = asyncio.ensure_future(ping()) if self.ping_interval > 0 else None
        if self.stall_timeout > 0:
            stall_timer = loop.call_later(self.stall_timeout, watch_stall)
        try:
            await producer
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this response is cancelled (the server shuts down), not just ended
        except (OSError, RuntimeError) as exc:  # sending failed: the client is gone
            log.debug("a stream's response ended: %r", exc)
        finally:
            producer.cancel()
            watcher.cancel()
            if pinger is not None:
                pinger.cancel()
            if stall_timer is not None:
                stall_timer.cancel()
            await _closed(self.on_close, stalled, self.stall_timeout, receive)


async def _closed(
    on_close: Callable[[], Awaitable[None] | None],
    stalled: bool,
    stall_timeout: float,
    receive: Receive,
) -> None:
    """A stream's end, however it came: its work closed, and a stalled client dropped."""
    closing = on_close()
    if closing is not None:
        # Shielded: a cancelled response must still abort and release its work.
        await asyncio.shield(asyncio.ensure_future(closing))
    if stalled:
        log.warning(
            "a streaming client read nothing for %gs: its request was aborted", stall_timeout
        )
        await _drop_connection(receive)


class Relayed(Protocol):
    """What :class:`RelayResponse` forwards (``upstream.backend.Passthrough``)."""

    def relay(self, write: Callable[[bytes], None]) -> Any:
        """Start handing whole events to ``write``; the relay (``done``, ``pause``,
        ``resume``, ``resumable`` and ``continued``: ``upstream.backend.Relay``)."""
        ...


# A client this far behind (bytes in its socket's write buffer) pauses the upstream.
RELAY_HIGH_WATER = 64 * 1024


class RelayResponse:
    """An upstream's SSE events to the client at the wire's pace: written to the client's
    transport by the upstream connection's own callback as they arrive
    (``Passthrough.relay``), with no task woken and no ASGI message per event, which is
    what an event cost a gateway (``benchmarks/fanout.py``). The head and the end go
    through ASGI as usual; the body bytes take the chunked framing the server chose.

    A client that reads slowly: past :data:`RELAY_HIGH_WATER` buffered bytes the
    upstream's socket is paused until the server's flow control says the client caught
    up; paused longer than ``stall_timeout`` s ends the response as :class:`SSEResponse`
    does. A disconnect ends it at once (``on_close`` aborts the upstream request). An
    error after the first byte (the upstream dropped the stream; a cancel) ends it with
    ``failure_frame``, unless another replica continues the dropped stream (failover:
    its continuation is written as it comes, one piece at a time). Under a server that
    is not uvicorn, ``fallback`` answers.
    """

    def __init__(
        self,
        answer: Relayed,
        fallback: SSEResponse,
        *,
        on_close: Callable[[], Awaitable[None] | None],
        stall_timeout: float,
        headers: list[tuple[bytes, bytes]],
        failure_frame: Callable[[BaseException], bytes],
    ) -> None:
        self.answer = answer
        self.fallback = fallback
        self.on_close = on_close
        self.stall_timeout = stall_timeout
        self.headers = headers
        self.failure_frame = failure_frame

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send: Any = scope.get(RAW_SEND, send)
        # uvicorn's send is a method of the request cycle, which holds the transport,
        # the flow control and whether the body is chunked.
        cycle: Any = getattr(body_send, "__self__", None)
        transport: Any = getattr(cycle, "transport", None)
        flow: Any = getattr(cycle, "flow", None)
        if transport is None or flow is None or not hasattr(cycle, "chunked_encoding"):
            await self.fallback(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        chunked = bool(cycle.chunked_encoding)
        state = _RelayState(loop)

        def write(data: bytes) -> None:
            if transport.is_closing():
                return
            transport.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            if not state.paused and transport.get_write_buffer_size() > RELAY_HIGH_WATER:
                state.paused = True
                if not state.continuing:
                    relay.pause()
                state.wake()

        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(state.leave)
        stalled = False
        try:
            relay = self.answer.relay(write)
            relay.done.add_done_callback(lambda _: state.wake())
            while not relay.done.done() and not state.gone:
                await state.woken()
                if state.paused and not relay.done.done() and not state.gone:
                    try:
                        timeout = self.stall_timeout if self.stall_timeout > 0 else None
                        await asyncio.wait_for(flow.drain(), timeout)
                    except TimeoutError:
                        stalled = True
                        break
                    state.paused = False
                    relay.resume()
            if not stalled and not state.gone:
                error = relay.done.result()
                if error is not None and relay.resumable:  # another replica continues it
                    error, stalled = await _continuing(
                        relay, state, flow, write, self.stall_timeout
                    )
                if error is not None and not stalled and not state.gone:
                    write(self.failure_frame(error))  # after the first byte: its frame ends it
                if not stalled and not state.gone:
                    await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        except SluiceError as exc:  # refused at the start (a cancel came first)
            write(self.failure_frame(exc))
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, RuntimeError) as exc:  # sending failed: the client is gone
            log.debug("a relayed response ended: %r", exc)
        finally:
            watcher.cancel()
            await _closed(self.on_close, stalled, self.stall_timeout, receive)


async def _continuing(
    relay: Any, state: _RelayState, flow: Any, write: Callable[[bytes], None], stall: float
) -> tuple[SluiceError | None, bool]:
    """A dropped stream's continuation from another replica, written as it comes: the
    error that ends it (None: it finished), and whether the client stalled."""
    state.continuing = True
    task = asyncio.current_task()
    state.on_leave = task.cancel if task is not None else None
    try:
        async for piece in relay.continued():
            write(piece)
            if state.paused:
                try:
                    await asyncio.wait_for(flow.drain(), stall if stall > 0 else None)
                except TimeoutError:
                    return None, True
                state.paused = False
    except SluiceError as exc:
        return exc, False
    except asyncio.CancelledError:
        if not state.gone or task is None or task.uncancel() > 0:
            raise
        return None, False  # the client left: its close aborts the continuation
    finally:
        state.on_leave = None
    return None, False


class _RelayState:
    """What a relay's writer (in the upstream's callback) tells its response's task: one
    future at a time, woken when the client falls behind or the relay ends."""

    __slots__ = ("_future", "_loop", "continuing", "gone", "on_leave", "paused")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] = loop.create_future()
        self.paused = False
        self.gone = False  # the client disconnected
        self.continuing = False  # another replica's continuation is being written
        self.on_leave: Callable[[], object] | None = None  # what a disconnect interrupts

    def leave(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled():
            self.gone = True
            self.wake()
            if self.on_leave is not None:
                self.on_leave()

    def wake(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    async def woken(self) -> None:
        await self._future
        self._future = self._loop.create_future()


async def _drop_connection(receive: Receive) -> None:
    """End a stalled client's connection now, with a reset, unsent bytes and all.

    ASGI has no message for this. Returning with the response unfinished
    makes the server close the transport, but a close first flushes the
    write buffer, which a client that does not read never takes: the
    connection and its buffers would stay. uvicorn's ``receive`` is a method
    of the request cycle that holds the transport: abort that, with
    ``SO_LINGER`` 0 so that the kernel drops its send queue too (as nginx's
    ``reset_timedout_connection`` does). Elsewhere, the server's close stands.
    """
    # (uvloop's transports are not asyncio.Transport subclasses: duck typing.)
    transport: Any = getattr(getattr(receive, "__self__", None), "transport", None)
    if not callable(getattr(transport, "abort", None)):
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    # Let the server see the connection lost before the app returns, so that it
    # does not log the unfinished response as an application error.
    await asyncio.sleep(0)


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


def wants_sse(request: Request) -> bool:
    """The client asked for SSE (``Accept: text/event-stream``): errors before the stream
    are then one ``event: error`` frame."""
    return "text/event-stream" in request.headers.get("accept", "")
