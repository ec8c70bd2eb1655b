"""A lean HTTP/1.1 client for upstream servers: what a gateway's streaming path needs.

A gateway holds one upstream connection per stream in flight and forwards every event
as it comes, so the client's cost per body chunk and per connection decides how many
streams one core carries. httpx (on httpcore and h11) spent most of a core at 256
streams: its connection pool walks every connection on each request and each close,
and each chunk passes through several async generators and a pure-Python parser.
Measured with ``benchmarks/fanout.py``. This client is an :class:`asyncio.Protocol`
per connection with httptools' parser (llhttp, the one uvicorn uses): a chunk from the
socket is parsed where it arrives and handed to the reader's one waiting future, and
nothing here walks other connections.

* Keep-alive connections per origin, reused last-in first-out; an idle one the
  server closed is dropped when found, and a request whose reused connection
  closes before any byte of the answer is sent again on a new one (the server
  never saw it).
* ``timeout``: the longest the server may send nothing while the reader waits
  (for the head, and between body bytes); a reader that does not read pauses the
  socket (flow control) and is never a timeout. ``connect_timeout``: to connect.
* Errors are typed (:class:`WireError` and its kinds), for the pool to map.

Example::

    client = WireClient(connect_timeout=5, timeout=300)
    origin = Origin.parse("http://127.0.0.1:8080")
    response = await client.request("POST", origin, "/v1/chat/completions", body, headers)
    while chunk := await response.read_some():
        forward(chunk)
    await response.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import os
import select
import socket
import ssl as _ssl
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import urlsplit

import httptools

# How long a host name's addresses are used once looked up. A connection's address is
# its own for as long as it is kept; this bounds how late a changed name is seen by new
# ones (Envoy's DNS refresh: 5 s; Go's and reqwest's clients: every connect).
RESOLVED_FOR = 10.0

# A reader this far behind pauses the socket until it catches up.
HIGH_WATER = 256 * 1024


class WireError(Exception):
    """A transport failure; ``kind`` says which, for a message."""

    kind: Literal["refused", "unreachable", "connect_timeout", "timeout", "broken", "protocol"]


class ConnectRefused(WireError):
    kind = "refused"


class Unreachable(WireError):
    kind = "unreachable"


class ConnectTimeout(WireError):
    kind = "connect_timeout"


class ReadTimeout(WireError):
    kind = "timeout"


class Broken(WireError):
    """The connection broke (reset, closed mid-answer, a write failed)."""

    kind = "broken"


class ProtocolError(WireError):
    """The server's bytes are not an HTTP/1.1 response."""

    kind = "protocol"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where requests go: scheme, host and port, parsed once."""

    scheme: str
    host: str
    port: int
    authority: bytes  # the Host header's value
    # The address family of a host written as an IP address (None for a name, whose
    # addresses are looked up): such an origin is connected to without a lookup.
    family: int | None = None

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            ip = ipaddress.ip_address(parts.hostname)
        except ValueError:
            family = None
        else:
            family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        return cls(parts.scheme, parts.hostname, port, parts.netloc.encode("ascii"), family)


class WireResponse:
    """An answer whose head has arrived; its body is read with :meth:`read_some`.

    Always closed (:meth:`aclose`): a complete answer's connection goes back to the
    pool, an unfinished one's is dropped (the server sees the request aborted).
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_on_end",
        "_paused",
        "_released",
        "_sink",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers  # names in lower case; repeated ones joined with ", "
        self._conn = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._error: WireError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._released = False
        self._sink: Callable[[bytes], None] | None = None  # see :meth:`relay`
        self._on_end: Callable[[WireError | None], None] | None = None

    @property
    def complete(self) -> bool:
        """The whole body has arrived."""
        return self._done

    # -- the connection's side ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        elif self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause()

    def _end(self, error: WireError | None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        on_end = self._on_end
        if on_end is not None:
            self._sink = self._on_end = None
            on_end(error)
            return
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the reader's side -------------------------------------------------------------

    def relay(
        self, sink: Callable[[bytes], None], on_end: Callable[[WireError | None], None]
    ) -> None:
        """Hand the body to ``sink`` as it arrives, in the connection's own callback (no
        task wakes per chunk), and its end to ``on_end`` (None, or the error that cut it);
        what arrived before goes to ``sink`` at once. Instead of :meth:`read_some`, for a
        gateway's passthrough. The sink may :meth:`pause` the socket and :meth:`resume` it
        (a client that reads slowly); the silence timeout runs while it is not paused."""
        chunks, self._chunks = self._chunks, []
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        self._sink, self._on_end = sink, on_end
        for chunk in chunks:
            sink(chunk)
        if self._done or self._error is not None:
            self._sink = self._on_end = None
            on_end(self._error)
            return
        self._conn.waiting()

    def pause(self) -> None:
        """Stop reading the socket (a relay's client is behind)."""
        if not self._paused:
            self._paused = True
            self._conn.pause()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._conn.resume()
            self._conn.waiting()

    async def read_some(self) -> bytes:
        """The body's next bytes as they arrived (b"" at its end); raises
        :class:`WireError` if the connection fails first."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            waiter = self._waiter = self._conn.loop.create_future()
            self._conn.waiting()
            try:
                await waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    async def aread(self) -> bytes:
        """The whole body (the rest of it)."""
        parts = []
        while data := await self.read_some():
            parts.append(data)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Done with it (idempotent): the connection is reused if the answer is complete."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose`, which never waits: for callers that cannot await."""
        if self._released:
            return
        self._released = True
        self._conn.release(self)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: a request at a time, its answer parsed as it arrives."""

    def __init__(self, client: WireClient, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False  # it answered a request before this one
        self.idle_since = 0.0
        self._head: asyncio.Future[WireResponse] | None = None
        self._headers: dict[str, str] = {}
        self._response: WireResponse | None = None
        self._received = False  # a byte of the current answer has arrived
        self._keep_alive = False
        self._until_close = False  # the body ends with the connection (no length given)
        self._quiet_since = 0.0  # when the server last sent, or the reader began to wait
        self._timer: asyncio.TimerHandle | None = None
        self._drain: asyncio.Future[None] | None = None
        self._timeout = client.timeout

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance.)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._received = True
        self._quiet_since = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"sent what is not an HTTP/1.1 response ({exc})"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self._response is not None and self._until_close and exc is None:
            self._finish_message()  # a body delimited by the connection's end
            return
        detail = f" ({exc})" if exc is not None else ""
        self._fail(Broken(f"closed the connection{detail}"))

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- httptools' callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self._headers.get(key)
        self._headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = {}
            return
        headers, self._headers = self._headers, {}
        self._keep_alive = self.parser.should_keep_alive()
        self._until_close = (
            "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower()
            and status not in (204, 304)
        )
        response = self._response = WireResponse(self, status, headers)
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._finish_message()

    # -- the client's side -------------------------------------------------------------

    async def send(self, head: bytes, body: bytes, timeout: float) -> WireResponse:
        """Write a request; the answer once its head has arrived."""
        assert self.transport is not None
        answer = self.expect(timeout)
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return await self.answer(answer)

    def expect(self, timeout: float) -> asyncio.Future[WireResponse]:
        """A request is (being) written: its answer is the next to arrive, and the
        future returned has it once its head has arrived (for :meth:`answer`)."""
        self._timeout = timeout
        self._received = False
        self._response = None
        head = self._head = self.loop.create_future()
        return head

    async def answer(self, head: asyncio.Future[WireResponse]) -> WireResponse:
        """The answer :meth:`expect` promised, once the request is written."""
        if self._drain is not None:
            self.waiting()
            await self._drain
        self.waiting()
        return await head

    def waiting(self) -> None:
        """The reader waits for the server now: the silence timer runs from here."""
        self._quiet_since = self.loop.time()
        if self._timer is None and self._timeout > 0:
            self._timer = self.loop.call_at(self._quiet_since + self._timeout, self._check_quiet)

    def _check_quiet(self) -> None:
        self._timer = None
        response = self._response
        waiting = (self._head is not None and not self._head.done()) or (
            response is not None
            and (
                response._waiter is not None
                or (response._sink is not None and not response._paused)
            )
        )
        drain = self._drain is not None
        if not (waiting or drain) or self.closed:
            return  # nobody waits: the timer is re-armed by the next wait
        due = self._quiet_since + self._timeout
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check_quiet)
            return
        self._fail(ReadTimeout(f"sent nothing for {self._timeout:g} s"))
        self.abort()

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()
            self._quiet_since = self.loop.time()

    def _finish_message(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            response._end(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, error: WireError) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_exception(error)
        response, self._response = self._response, None
        if response is not None:
            response._end(error)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self, response: WireResponse) -> None:
        """The reader is done with ``response``: keep the connection if it can serve again."""
        if response.complete and self._keep_alive and not self.closed and self._response is None:
            if response._paused:
                self.resume()
            self.reused = True
            self.client._idle(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self._fail(Broken("closed by sluice"))
        if self.transport is not None:
            self.transport.abort()


class WireClient:
    """Keep-alive HTTP/1.1 (and HTTPS) connections to any number of origins.

    ``max_idle`` connections per origin are kept for reuse, each for ``idle_expiry``
    seconds at most; there is no cap on connections in use (the server's own limits
    bound how many requests are in flight).
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        timeout: float,
        # A gateway that holds a thousand streams to a replica keeps their connections.
        max_idle: int = 2048,
        # 90 s: Go's net/http and Rust's reqwest keep an idle connection as long, the
        # clients most gateways are written on. A server that closes one sooner is seen
        # at its reuse, and a request it never read is sent again on a new connection.
        idle_expiry: float = 90.0,
        ssl_context: _ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.max_idle = max_idle
        self.idle_expiry = idle_expiry
        self._ssl = ssl_context
        self._pools: dict[Origin, list[_Connection]] = {}
        self._closed = False
        # Host names' addresses (until when, [(family, address)]), and lookups under way.
        self._resolved: dict[tuple[str, int], tuple[float, list[tuple[int, tuple[Any, ...]]]]] = {}
        self._resolving: dict[
            tuple[str, int], asyncio.Future[list[tuple[int, tuple[Any, ...]]]]
        ] = {}

    async def request(
        self,
        method: str,
        origin: Origin,
        target: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        *,
        timeout: float | None = None,
    ) -> WireResponse:
        """Send a request to ``origin`` (``target``: the path and query); the answer
        once its head arrived. ``timeout`` overrides the client's for this request.
        Raises :class:`WireError`."""
        quiet = self.timeout if timeout is None else timeout
        if self._closed:
            raise Broken("the client is closed")
        head = _head(method, origin, target, body, headers)
        conn = self._take(origin)
        while conn is not None:  # a kept-alive connection; the server may have closed it
            try:
                return await conn.send(head, body, quiet)
            except Broken:
                if conn._received or not conn.reused:
                    raise
                conn = self._take(origin)  # it never saw the request: try another
            except BaseException:
                conn.abort()  # cancelled, or timed out: the connection is in no state to reuse
                raise
        if origin.scheme == "http":
            return await self._connect_sending(origin, head, body, quiet)
        conn = await self._connect(origin)  # TLS: its handshake takes turns of the loop
        try:
            return await conn.send(head, body, quiet)
        except BaseException:
            conn.abort()
            raise

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._pools.get(origin)
        if not idle:
            return None
        oldest = time.monotonic() - self.idle_expiry
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= oldest:
                return conn
            conn.abort()
        return None

    def _idle(self, conn: _Connection) -> None:
        idle = self._pools.setdefault(conn.origin, [])
        if self._closed or len(idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _connect(self, origin: Origin) -> _Connection:
        """A connection over TLS, its handshake done (within the connect timeout too)."""
        loop = asyncio.get_running_loop()
        ssl = self._ssl or _ssl.create_default_context()
        sock = await self._open(loop, origin)
        try:
            with _connect_errors(self.connect_timeout):
                async with asyncio.timeout(self.connect_timeout):
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self, origin, loop),
                        sock=sock,
                        ssl=ssl,
                        server_hostname=origin.host,
                    )
        except BaseException:
            sock.close()
            raise
        return conn

    async def _connect_sending(
        self, origin: Origin, head: bytes, body: bytes, quiet: float
    ) -> WireResponse:
        """Connect over plain HTTP, and write the request the moment the connection is
        up: without waiting for a turn of the event loop when it is up at once
        (loopback, and a host on the same machine) and the host is an IP address or
        one resolved in the last :data:`RESOLVED_FOR` seconds.

        A burst of requests arrives in one read of many sockets, and each one's task
        runs up to its connect before any of them runs on; a connect awaited the usual
        way is seen only after the whole burst's tasks ran, so the upstream would get
        the first request of a burst of 256 some 60 ms late and every request behind
        it later still (``benchmarks/fanout.py``). Written at once, the upstream works
        on each request while sluice reads the next one, as with a kept-alive one."""
        loop = asyncio.get_running_loop()
        sock = await self._open(loop, origin)
        try:
            request = head + body
            try:
                sent = sock.send(request)
            except BlockingIOError:
                sent = 0
            conn = _Connection(self, origin, loop)
            answer = conn.expect(quiet)  # it may arrive before this task runs on
            await loop.create_connection(lambda: conn, sock=sock)
        except OSError as exc:
            sock.close()
            raise Unreachable(f"could not be reached ({exc.strerror or exc})") from exc
        except BaseException:
            sock.close()
            raise
        try:
            if sent < len(request):
                assert conn.transport is not None
                conn.transport.write(request[sent:])
            return await conn.answer(answer)
        except BaseException:
            conn.abort()
            raise

    async def _open(self, loop: asyncio.AbstractEventLoop, origin: Origin) -> socket.socket:
        """A socket connected to ``origin`` (its addresses tried in turn), within the
        connect timeout; raises the :class:`WireError` of the last failure."""
        with _connect_errors(self.connect_timeout):
            async with asyncio.timeout(self.connect_timeout):
                addresses = await self._addresses(loop, origin)
                failure: OSError | None = None
                for family, address in tuple(addresses):  # (shared: reordered by others)
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    try:
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        rc = sock.connect_ex(address)
                        if rc == errno.EINPROGRESS and not _writable(sock):
                            await _wait_writable(loop, sock)
                        elif rc not in (0, errno.EINPROGRESS):
                            raise OSError(rc, os.strerror(rc))
                        rc = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if rc:
                            raise OSError(rc, os.strerror(rc))
                    except OSError as exc:
                        sock.close()
                        failure = exc
                        continue
                    except BaseException:
                        sock.close()
                        raise
                    if addresses[0] != (family, address) and (family, address) in addresses:
                        addresses.remove((family, address))  # the one that answers: first
                        addresses.insert(0, (family, address))
                    return sock
                assert failure is not None
                raise failure

    async def _addresses(
        self, loop: asyncio.AbstractEventLoop, origin: Origin
    ) -> list[tuple[int, tuple[Any, ...]]]:
        """``origin``'s socket addresses: its IP address, or its name's, looked up once
        for :data:`RESOLVED_FOR` seconds (a burst's requests share one lookup)."""
        if origin.family is not None:
            return [(origin.family, (origin.host, origin.port))]
        name = (origin.host, origin.port)
        known = self._resolved.get(name)
        if known is not None and known[0] > loop.time():
            return known[1]
        lookup = self._resolving.get(name)
        if lookup is None:
            lookup = self._resolving[name] = asyncio.ensure_future(self._lookup(loop, origin))
            lookup.add_done_callback(lambda _: self._resolving.pop(name, None))
        return await asyncio.shield(lookup)

    async def _lookup(
        self, loop: asyncio.AbstractEventLoop, origin: Origin
    ) -> list[tuple[int, tuple[Any, ...]]]:
        infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
        addresses: list[tuple[int, tuple[Any, ...]]] = []
        for family, _, _, _, address in infos:
            if (family, address) not in addresses:
                addresses.append((family, address))
        if not addresses:
            raise OSError(f"{origin.host} has no address")
        self._resolved[(origin.host, origin.port)] = (loop.time() + RESOLVED_FOR, addresses)
        return addresses

    async def aclose(self) -> None:
        """Close every idle connection; answers still being read keep theirs until closed."""
        self._closed = True
        pools, self._pools = self._pools, {}
        for idle in pools.values():
            for conn in idle:
                conn.abort()


@contextlib.contextmanager
def _connect_errors(timeout: float) -> Iterator[None]:
    """A failure to connect as its :class:`WireError`."""
    try:
        yield
    except TimeoutError:
        raise ConnectTimeout(f"did not accept the connection within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise ConnectRefused("refused the connection") from None
    except OSError as exc:
        raise Unreachable(f"could not be reached ({exc.strerror or exc})") from exc


def _writable(sock: socket.socket) -> bool:
    """Whether ``sock`` can be written now (a connect in progress has finished)."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0))


async def _wait_writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def up() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, up)
    try:
        await ready
    finally:
        loop.remove_writer(fd)


def _head(
    method: str, origin: Origin, target: str, body: bytes, headers: Mapping[str, str] | None
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {origin.authority.decode('ascii')}"]
    for name, value in (headers or {}).items():
        if "\n" in name or "\r" in name or "\n" in value or "\r" in value:
            raise ValueError(f"the header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body or method == "POST":
        lines.append(f"content-length: {len(body)}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")
