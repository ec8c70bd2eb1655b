"""Reading a request body within the size limit, and answering an oversized one.

Example::

    raw = await read_body(request, limit=8 * 1024 * 1024)   # BodyTooLarge past the limit

An oversized body is answered 413 only after the rest of it has been read
and thrown away (up to :func:`drain_allowance` bytes in all and
``DRAIN_SECONDS``): a client that writes its whole body before reading
(``urllib.request``, ``requests``, most scripts) gets the 413 instead of a
connection reset, because a socket closed with unread input makes the kernel
send RST, which can destroy the response in flight. The connection then
stays usable.

When the rest of the body is not read, the error asks for ``Connection:
close`` (:class:`~sluice.core.errors.BodyTooLarge` ``close=True``), because the
connection is then out of step with the client: with keep-alive, uvicorn
would discard whatever follows as the old body, without bound, or (after an
``Expect: 100-continue`` the client never got) take the client's next request
for it. That happens:

* at once, without reading, for ``Expect: 100-continue`` with a
  Content-Length over the limit (uvicorn sends ``100 Continue`` only when the
  app first reads, so the client has not sent the body);
* at once for a Content-Length over the drain allowance;
* when a chunked body runs past the allowance, or the drain takes longer
  than ``DRAIN_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request

from sluice.core.errors import BodyTooLarge, ShuttingDown

# An oversized body is read and discarded up to this many times the limit in
# all, and at most DRAIN_EXTRA_CAP bytes past the limit...
DRAIN_FACTOR = 4
DRAIN_EXTRA_CAP = 64 * 1024 * 1024
# ... and for at most this many seconds (read at call time: tests shorten it).
DRAIN_SECONDS = 10.0


def drain_allowance(limit: int) -> int:
    """The most body bytes read in all (kept and discarded) before a 413."""
    return min(DRAIN_FACTOR * limit, limit + DRAIN_EXTRA_CAP)


async def read_body(request: Request, limit: int) -> bytes:
    declared = _content_length(request)
    allowance = drain_allowance(limit)
    over = declared is not None and declared > limit
    first: bytes | None = None  # the first message's body, when read already
    more = True  # more of the body is to be received
    if over:
        message = f"The request body is {declared} bytes; the limit is {limit}."
        if _expects_continue(request) or (declared is not None and declared > allowance):
            raise BodyTooLarge(message, close=True)
    else:
        message = f"The request body is over the limit of {limit} bytes."
        # The usual case, a body that came whole in one message, without the stream's
        # generator (a gateway reads one per request: measured on the fan-out benchmark).
        received_message = await request.receive()
        if received_message["type"] == "http.disconnect":
            raise ClientDisconnect()
        first = received_message.get("body", b"")
        more = received_message.get("more_body", False)
        if not more and len(first) <= limit:
            request._body = first  # request.body() and .stream() still work
            return first
    body = bytearray()
    received = 0
    async with contextlib.aclosing(_chunks(request, first, more)) as chunks:
        if not over:
            async for chunk in chunks:
                received += len(chunk)
                if received > limit:
                    over = True
                    break
                body += chunk
            if not over:
                return bytes(body)
        body.clear()
        complete = await _discard_rest(chunks, received, allowance)
    raise BodyTooLarge(message, close=not complete)


async def _chunks(request: Request, first: bytes | None, more: bool) -> AsyncGenerator[bytes, None]:
    """The body's chunks as ``request.stream()`` gives them, ``first`` already received
    (and ``more`` to come, or not)."""
    if first is not None:
        yield first
    if more:
        async for chunk in request.stream():
            yield chunk


async def read_request_body(
    request: Request, limit: int, draining: Callable[[], bool]
) -> bytes | None:
    """A generation request's body; None when the client left before it arrived.

    Refused with :class:`ShuttingDown` while the server drains, but only after
    the body is read: an unread body would reset the connection under the 503
    for a client that sent "Connection: close".
    """
    try:
        raw = await read_body(request, limit)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        return None
    if draining():
        raise ShuttingDown("The server is shutting down; no new requests are admitted.")
    return raw


def _content_length(request: Request) -> int | None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        return int(declared)
    return None


def _expects_continue(request: Request) -> bool:
    # The same test uvicorn applies before it sends "100 Continue" on the first read.
    return request.headers.get("expect", "").lower() == "100-continue"


async def _discard_rest(chunks: AsyncIterator[bytes], received: int, allowance: int) -> bool:
    """Read and drop the rest of the body: True when it ended within the bounds."""
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            async for chunk in chunks:
                received += len(chunk)
                if received > allowance:
                    return False
    except (TimeoutError, ClientDisconnect):
        # A client gone mid-body reads no answer: the 413 goes nowhere, quietly.
        return False
    return True
