"""The gateway's HTTP/1.1 client (``upstream/wire.py``) against raw loopback servers: body
framings, keep-alive and its stale connections, flow control, timeouts, bad answers."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from sluice.upstream import wire
from sluice.upstream.wire import Origin, WireClient
from tests.support.servers import free_port
from tests.support.tls import certificates

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":")[1])
    return head.decode().split(" ")[1], await reader.readexactly(length)


class Server:
    """A loopback server running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[Server, Origin]]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> tuple[Server, Origin]:
        srv = Server(handler)
        server = await asyncio.start_server(srv._serve, "127.0.0.1", 0)
        servers.append(server)
        return srv, Origin.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")

    yield start
    for server in servers:
        server.close()


def client(**kw: float) -> WireClient:
    kw.setdefault("connect_timeout", 1.0)
    kw.setdefault("timeout", 5.0)
    return WireClient(**kw)


async def test_framings_and_keep_alive(
    serve: Callable[..., Awaitable[tuple[Server, Origin]]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            path, body = await read_request(reader)
            if path == "/length":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\nX-A: 2\r\n\r\nhello"
                )
            elif path == "/chunked":
                writer.write(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n")
                for part in (b"ab", b"cde", b""):
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await writer.drain()
                    await asyncio.sleep(0.01)
            elif path == "/echo":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            else:  # no length: the body ends with the connection
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
                await writer.drain()
                return

    srv, origin = await serve(handler)
    c = client()
    r = await c.request("GET", origin, "/length")
    assert (r.status, r.headers["x-a"], await r.aread()) == (200, "1, 2", b"hello")
    await r.aclose()
    r = await c.request("POST", origin, "/chunked", b"{}")
    assert r.status == 201
    parts = []
    while data := await r.read_some():
        parts.append(data)
    assert b"".join(parts) == b"abcde" and len(parts) >= 2  # as the chunks came
    await r.aclose()
    big = bytes(range(256)) * 1000  # written in two pieces
    r = await c.request("POST", origin, "/echo", big, {"content-type": "application/json"})
    assert await r.aread() == big
    await r.aclose()
    assert srv.connections == 1  # all on one kept-alive connection
    r = await c.request("GET", origin, "/close")
    assert await r.aread() == b"until the end"
    await r.aclose()
    await c.aclose()


async def test_a_stale_idle_connection_is_replaced(
    serve: Callable[..., Awaitable[tuple[Server, Origin]]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        # Keep-alive announced, then the next request is met with a close and no answer
        # (a server's idle timeout racing the client's reuse).
        await read_request(reader)

    srv, origin = await serve(handler)
    c = client()
    for _ in range(3):
        r = await c.request("POST", origin, "/x", b"{}")
        assert await r.aread() == b"ok"
        await r.aclose()
    assert srv.connections == 3  # each reuse failed before an answer and was sent again
    await c.aclose()


async def test_an_unfinished_answer_is_not_reused(
    serve: Callable[..., Awaitable[tuple[Server, Origin]]],
) -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        if await reader.read(1) == b"":
            gone.set()

    srv, origin = await serve(handler)
    c = client()
    r = await c.request("POST", origin, "/x", b"{}")
    assert await r.read_some() == b"hi"
    await r.aclose()  # before the end: the connection is dropped
    await asyncio.wait_for(gone.wait(), 2)
    r = await c.request("POST", origin, "/x", b"{}")
    await r.aclose()
    assert srv.connections == 2
    await c.aclose()


async def test_a_reader_that_does_not_read_pauses_the_server(
    serve: Callable[..., Awaitable[tuple[Server, Origin]]],
) -> None:
    sent = 0
    blocks = 1000  # 65 MB: more than the sockets' buffers hold, however they are tuned

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        block = b"x" * 65536
        for _ in range(blocks):
            writer.write(b"%x\r\n%s\r\n" % (len(block), block))
            await writer.drain()
            sent += len(block)
        writer.write(b"0\r\n\r\n")

    _, origin = await serve(handler)
    c = client(timeout=0.3)
    r = await c.request("POST", origin, "/x", b"{}")
    await asyncio.sleep(0.5)
    held = sent
    await asyncio.sleep(0.5)  # past the timeout: not reading is not the server's silence
    assert sent == held < blocks * 65536  # the server was held back, and stays so
    total = 0
    while data := await r.read_some():
        total += len(data)
    assert total == blocks * 65536
    await r.aclose()
    await c.aclose()


async def test_silence_is_a_timeout(serve: Callable[..., Awaitable[tuple[Server, Origin]]]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path, _ = await read_request(reader)
        if path == "/late-body":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
            await writer.drain()
        await asyncio.sleep(10)

    _, origin = await serve(handler)
    c = client(timeout=0.2)
    with pytest.raises(wire.ReadTimeout, match="sent nothing for 0.2 s"):
        await c.request("POST", origin, "/no-head", b"{}")
    r = await c.request("POST", origin, "/late-body", b"{}")
    assert await r.read_some() == b"a"
    with pytest.raises(wire.ReadTimeout):
        await r.read_some()
    await r.aclose()
    await c.aclose()


async def test_refused_garbage_and_interim(
    serve: Callable[..., Awaitable[tuple[Server, Origin]]],
) -> None:
    c = client()
    with pytest.raises(wire.ConnectRefused, match="refused the connection"):
        await c.request("GET", Origin.parse(f"http://127.0.0.1:{free_port()}"), "/")

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await asyncio.sleep(1)

    _, origin = await serve(garbage)
    with pytest.raises(wire.ProtocolError, match="not an HTTP/1.1 response"):
        await c.request("GET", origin, "/")

    async def interim(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n!")
        await asyncio.sleep(1)

    _, origin = await serve(interim)
    r = await c.request("GET", origin, "/")
    assert (r.status, await r.aread()) == (200, b"!")
    await r.aclose()
    await c.aclose()


async def test_cancelled_while_waiting_drops_the_connection(
    serve: Callable[..., Awaitable[tuple[Server, Origin]]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            path, _ = await read_request(reader)
            if path == "/slow":
                await asyncio.sleep(0.5)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    srv, origin = await serve(handler)
    c = client()
    r = await c.request("GET", origin, "/fast")
    await r.aread()
    await r.aclose()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(c.request("GET", origin, "/slow"), 0.1)
    # The kept-alive connection was in use when cancelled: never handed out again, or
    # its late answer would be read as the next request's.
    r = await c.request("GET", origin, "/fast")
    assert await r.aread() == b"ok"
    await r.aclose()
    assert srv.connections == 2
    await c.aclose()


def _one_answer_server(got: threading.Event, connections: int = 1) -> int:
    """A thread serving ``connections`` connections, one request each: it sets ``got``
    once the last one's request head arrived, and answers "ok" (closing all but the
    last connection)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            for i in range(connections):
                conn, _ = listener.accept()
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(4096)
                    last = i == connections - 1
                    if last:
                        got.set()
                    close = b"" if last else b"connection: close\r\n"
                    conn.sendall(b"HTTP/1.1 200 OK\r\n%scontent-length: 2\r\n\r\nok" % close)
                    if last:
                        conn.recv(1)  # until the client closes

    threading.Thread(target=serve, daemon=True).start()
    port: int = listener.getsockname()[1]
    return port


@pytest.mark.parametrize(
    ("loop", "host"), [("asyncio", "127.0.0.1"), ("uvloop", "127.0.0.1"), ("uvloop", "localhost")]
)
def test_a_new_connection_carries_its_request_at_once(loop: str, host: str) -> None:
    """Over plain HTTP the request is written in the task's own step, with the connect:
    a burst's first requests reach the upstream while sluice reads the burst's others,
    not after (``_connect_sending``). A host name's addresses are looked up by its
    first connection, then kept (``RESOLVED_FOR``)."""
    got = threading.Event()
    port = _one_answer_server(got, connections=2)

    async def main() -> None:
        c = client()
        origin = Origin.parse(f"http://{host}:{port}")
        r = await c.request("POST", origin, "/v1/x", b"{}")  # closed after its answer
        assert await r.aread() == b"ok"
        await r.aclose()
        task = asyncio.ensure_future(c.request("POST", origin, "/v1/x", b"{}"))
        await asyncio.sleep(0)  # the request's first step runs
        # The loop is blocked here: a request sent once the loop saw the connect up
        # would not have left yet.
        assert got.wait(5.0), "the request waited for a turn of the event loop"
        r = await task
        assert (r.status, await r.aread()) == (200, b"ok")
        await r.aclose()
        await c.aclose()

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connect_not_up_at_once_is_waited_for(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    """A connect still in progress (a host across a network) is awaited on the loop
    (its socket watched, then handed to a transport), then the request is written; the
    connection is kept alive for the next."""
    monkeypatch.setattr(wire, "_writable", lambda sock: False)
    got = threading.Event()
    port = _one_answer_server(got, connections=2)

    async def main() -> None:
        c = client()
        origin = Origin.parse(f"http://127.0.0.1:{port}")
        for _ in range(2):  # the first connection closed after its answer
            r = await c.request("POST", origin, "/v1/x", b"{}")
            assert (r.status, await r.aread()) == (200, b"ok")
            await r.aclose()
        assert got.is_set()
        await c.aclose()

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


async def test_https_streams_keeps_alive_and_checks_the_certificate(tmp_path: Path) -> None:
    """Over TLS: a chunked stream read as it comes, the connection kept alive, and a
    certificate that is not trusted (or not for the host) refused before any request."""
    ca, cert, key = certificates(tmp_path, "localhost")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in (b"data: 1\n\n", b"data: 2\n\n", b""):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.01)

    srv = Server(handler)
    server = await asyncio.start_server(srv._serve, "127.0.0.1", 0, ssl=server_tls)
    port = server.sockets[0].getsockname()[1]
    try:
        c = WireClient(
            connect_timeout=2.0, timeout=5.0, ssl_context=ssl.create_default_context(cafile=ca)
        )
        origin = Origin.parse(f"https://localhost:{port}")
        for _ in range(2):
            r = await c.request("POST", origin, "/v1/chat/completions", b"{}")
            parts = []
            while data := await r.read_some():
                parts.append(data)
            assert r.status == 200 and b"".join(parts) == b"data: 1\n\ndata: 2\n\n"
            assert len(parts) >= 2  # as the chunks came
            await r.aclose()
        assert srv.connections == 1
        await c.aclose()

        untrusted = client()  # the system's CAs only
        with pytest.raises(wire.Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.request("POST", origin, "/v1/chat/completions", b"{}")
        other = WireClient(
            connect_timeout=2.0, timeout=5.0, ssl_context=ssl.create_default_context(cafile=ca)
        )
        with pytest.raises(wire.Unreachable, match="CERTIFICATE_VERIFY_FAILED"):  # wrong name
            await other.request("POST", Origin.parse(f"https://127.0.0.1:{port}"), "/", b"{}")
        assert srv.connections == 1  # no request reached the server over those
    finally:
        server.close()


async def test_a_names_addresses_are_tried_in_turn_and_looked_up_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name whose first address refuses (``localhost`` as ::1 before a server bound
    to 127.0.0.1 only) is connected on its next one, which is tried first from then
    on; a burst's connections share one lookup; a name that does not resolve is
    unreachable."""
    got = threading.Event()
    port = _one_answer_server(got, connections=3)
    closed = free_port()
    lookups: list[str] = []

    async def getaddrinfo(host: str, port_: int, **kw: object) -> list[tuple[Any, ...]]:
        lookups.append(host)
        await asyncio.sleep(0.05)
        if host == "nowhere.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        stream = socket.SOCK_STREAM
        return [
            (socket.AF_INET, stream, 6, "", ("127.0.0.1", closed)),
            (socket.AF_INET, stream, 6, "", ("127.0.0.1", port)),
        ]

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    c = client()
    origin = Origin.parse(f"http://upstream.test:{port}")
    answers = await asyncio.gather(*(c.request("POST", origin, "/", b"{}") for _ in range(3)))
    assert lookups == ["upstream.test"]  # one lookup for the three
    for r in answers:
        assert await r.aread() == b"ok"
        await r.aclose()
    assert c._resolved[("upstream.test", port)][1][0][1] == ("127.0.0.1", port)
    with pytest.raises(wire.Unreachable, match="Name or service not known"):
        await c.request("POST", Origin.parse("http://nowhere.invalid:80"), "/", b"{}")
    await c.aclose()
