"""The upstream replica pool: choice, failover, health checks, real sockets and scripted faults.

Real loopback servers (:class:`FakeUpstream`, raw HTTP/1.1 on asyncio) for what
only sockets show: refused connections, stalls, drops, aborts, keep-alive;
the same servers with scripted answers (statuses, headers, counts).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sluice.core.errors import UpstreamFailed, UpstreamTimeout, UpstreamUnavailable
from sluice.upstream import pool as pool_module
from sluice.upstream import wire
from sluice.upstream.config import UpstreamSpec
from sluice.upstream.pool import UpstreamPool
from tests.support.servers import free_port

SSE = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
BODY = b'{"model":"m1","stream":true,"messages":[{"role":"user","content":"x"}]}'


def make_spec(*urls: str, **kw: Any) -> UpstreamSpec:
    kw.setdefault("timeout", 5.0)
    kw.setdefault("connect_timeout", 1.0)
    kw.setdefault("health_interval", 60.0)
    return UpstreamSpec(name="gpu-box", urls=tuple(urls), **kw)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "BACKOFF_MIN", 0.1)


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


# -- a real upstream ----------------------------------------------------------------------


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeUpstream:
    """An OpenAI-ish server on a loopback port, raw HTTP/1.1 with keep-alive.

    ``chat`` says how it answers POSTs: ``ok`` (an SSE body), ``stall`` (never
    answers), ``drop`` (headers and one chunk, then the connection reset),
    ``slow`` (a chunk every 20 ms until the client goes: ``disconnected``).
    """

    def __init__(self, models: tuple[str, ...] = ("m1",)) -> None:
        self.models = models
        self.chat = "ok"
        # Scripted: a POST answered with (status, headers, body) from this.
        self.answer: Callable[[FakeUpstream], tuple[int, dict[str, str], bytes]] | None = None
        self.listing: bytes | None = None  # GET /v1/models answered with this instead
        self.gets: list[tuple[str, dict[str, str]]] = []
        self.posts: list[tuple[str, dict[str, str], bytes]] = []
        self.checks = 0
        self.connections = 0
        self.disconnected = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Gone: the port refuses connections and open connections are reset."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # stop(): ended quietly (asyncio logs a handler task ending cancelled)
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.transport.abort()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        first, *lines = head.decode().split("\r\n")
        method, path, _ = first.split(" ")
        headers = {}
        for line in lines:
            if line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if method == "GET" and path.endswith("/v1/models"):
            self.checks += 1
            self.gets.append((path, headers))
            data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]
            payload = self.listing or json.dumps({"object": "list", "data": data}).encode()
            writer.write(_head(200, {"content-length": str(len(payload))}) + payload)
            await writer.drain()
            return True
        self.posts.append((path, headers, body))
        if self.answer is not None:
            status, extra, content = self.answer(self)
            writer.write(_head(status, {**extra, "content-length": str(len(content))}) + content)
            await writer.drain()
            return True
        if self.chat == "stall":
            await asyncio.sleep(3600)
        if self.chat == "ok":
            sse = {"content-type": "text/event-stream", "content-length": str(len(SSE))}
            writer.write(_head(200, sse) + SSE)
            await writer.drain()
            return True
        writer.write(
            _head(200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"})
        )
        writer.write(_chunk(b'data: {"n":0}\n\n'))
        await writer.drain()
        if self.chat == "drop":
            await asyncio.sleep(0.05)
            return False  # reset by _handle, the chunked body unfinished
        eof = asyncio.ensure_future(reader.read(1))  # "slow": b"" when the client goes
        try:
            for n in range(1, 500):
                done, _ = await asyncio.wait({eof}, timeout=0.02)
                if done:
                    self.disconnected.set()
                    return False
                writer.write(_chunk(b'data: {"n":%d}\n\n' % n))
                await writer.drain()
        finally:
            eof.cancel()
        return False


@pytest.fixture
async def upstreams() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeUpstream] = []

    async def make(models: tuple[str, ...] = ("m1",)) -> FakeUpstream:
        up = await FakeUpstream(models).start()
        started.append(up)
        return up

    yield make
    for up in started:
        await up.stop()


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def collect(response: pool_module.UpstreamResponse) -> bytes:
    return b"".join([chunk async for chunk in response.aiter_raw()])


# -- real sockets -------------------------------------------------------------------------


async def test_discovers_models(upstreams: Callable[..., Any]) -> None:
    a = await upstreams(("m1", "m2"))
    b = await upstreams(("m2", "m3"))
    pool = UpstreamPool(make_spec(a.url, b.url))
    await pool.start()
    try:
        assert pool.models() == ("m1", "m2", "m3")
        assert pool.model_entries()["m3"] == {"id": "m3", "object": "model", "owned_by": "fake"}
        assert [s.state for s in pool.status()] == ["healthy", "healthy"]
        assert pool.status()[0].models == ("m1", "m2")
        assert pool.state() == "healthy"
        next_check = pool.status()[0].next_check_in
        assert next_check is not None and 55 < next_check <= 60
    finally:
        await pool.close()
    configured = UpstreamPool(make_spec(a.url, models=("only",)))
    await configured.start()
    assert configured.models() == ("only",)
    await configured.close()


async def test_refused_connection_fails_over(upstreams: Callable[..., Any]) -> None:
    good = await upstreams()
    dead = closed_url()
    pool = UpstreamPool(make_spec(dead, good.url))  # not started: both unknown, dead first
    try:
        async with await pool.send("/chat/completions", BODY) as response:
            assert response.status == 200
            assert response.replica == good.url
            assert await collect(response) == SSE
        down = pool.status()[0]
        assert down.state == "down" and down.failures >= 1
        assert down.last_error == f"{dead} refused the connection"
        assert pool.state() == "degraded"
        assert len(good.posts) == 1
    finally:
        await pool.close()


async def test_all_refused_then_unavailable() -> None:
    dead = closed_url()
    pool = UpstreamPool(make_spec(dead))
    try:
        with pytest.raises(UpstreamFailed) as failed:
            await pool.send("/chat/completions", BODY)
        assert type(failed.value) is UpstreamFailed
        assert failed.value.message == f"upstream 'gpu-box': {dead} refused the connection"
        # Now known down: refused at once with Retry-After, nothing sent.
        with pytest.raises(UpstreamUnavailable) as unavailable:
            await pool.send("/chat/completions", BODY)
        assert unavailable.value.retry_after >= 1
        assert unavailable.value.headers() == {"Retry-After": str(unavailable.value.retry_after)}
        assert "gpu-box" in unavailable.value.message
        assert pool.state() == "down"
    finally:
        await pool.close()


async def test_stall_before_first_byte_fails_over(upstreams: Callable[..., Any]) -> None:
    stalled = await upstreams()
    stalled.chat = "stall"
    good = await upstreams()
    pool = UpstreamPool(make_spec(stalled.url, good.url, timeout=0.3))
    await pool.start()
    try:
        started = time.monotonic()
        async with await pool.send("/chat/completions", BODY) as response:
            assert response.replica == good.url
            assert await collect(response) == SSE
        assert time.monotonic() - started >= 0.3
        assert len(stalled.posts) == 1
        status = pool.status()[0]
        assert status.state == "down"
        assert status.last_error == f"{stalled.url} sent nothing for 0.3 s"
    finally:
        await pool.close()


async def test_stall_alone_is_a_timeout(upstreams: Callable[..., Any]) -> None:
    stalled = await upstreams()
    stalled.chat = "stall"
    pool = UpstreamPool(make_spec(stalled.url, timeout=0.2))
    try:
        with pytest.raises(UpstreamTimeout, match="sent nothing for 0.2 s"):
            await pool.send("/chat/completions", BODY)
    finally:
        await pool.close()


async def test_drop_mid_stream(upstreams: Callable[..., Any]) -> None:
    up = await upstreams()
    up.chat = "drop"
    pool = UpstreamPool(make_spec(up.url))
    await pool.start()
    checks = up.checks
    try:
        response = await pool.send("/chat/completions", BODY)
        chunks: list[bytes] = []
        with pytest.raises(UpstreamFailed, match="dropped the stream") as dropped:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
        assert type(dropped.value) is UpstreamFailed
        assert b"".join(chunks) == b'data: {"n":0}\n\n'
        assert pool.status()[0].outstanding == 0
        # Suspect, not down: checked at once (the interval is 60 s), and healthy again.
        await wait_for(lambda: up.checks > checks)
        assert pool.status()[0].state == "healthy"
    finally:
        await pool.close()


async def test_aclose_aborts_the_upstream_request(upstreams: Callable[..., Any]) -> None:
    up = await upstreams()
    up.chat = "slow"
    pool = UpstreamPool(make_spec(up.url))
    await pool.start()
    try:
        response = await pool.send("/chat/completions", BODY)
        assert pool.status()[0].outstanding == 1
        stream = response.aiter_raw()
        assert await stream.__anext__() == b'data: {"n":0}\n\n'
        await response.aclose()
        await response.aclose()  # idempotent
        await asyncio.wait_for(up.disconnected.wait(), 2)
        status = pool.status()[0]
        assert (status.outstanding, status.state, status.failures) == (0, "healthy", 0)
    finally:
        await pool.close()


async def test_connection_reused(upstreams: Callable[..., Any]) -> None:
    up = await upstreams()
    pool = UpstreamPool(make_spec(up.url))
    await pool.start()
    try:
        for _ in range(5):
            async with await pool.send("/chat/completions", BODY) as response:
                assert await response.aread() == SSE
        assert len(up.posts) == 5
        assert up.connections == 1  # the health check's connection, kept alive
    finally:
        await pool.close()


async def test_recovery(upstreams: Callable[..., Any]) -> None:
    a = await upstreams()
    b = await upstreams()
    pool = UpstreamPool(make_spec(a.url, b.url))
    await pool.start()
    try:
        await a.stop()
        for _ in range(2):
            async with await pool.send("/chat/completions", BODY) as response:
                assert response.replica == b.url
        assert pool.status()[0].state == "down"
        await a.start()  # the same port again
        await wait_for(lambda: pool.status()[0].state == "healthy")
        assert pool.state() == "healthy"
        replicas = []
        for _ in range(4):
            async with await pool.send("/chat/completions", BODY) as response:
                replicas.append(response.replica)
        assert replicas.count(a.url) == 2 and len(a.posts) == 2
    finally:
        await pool.close()


# -- scripted answers --------------------------------------------------------------------


def answering(
    status: int, body: bytes = b"x", headers: dict[str, str] | None = None
) -> Callable[[FakeUpstream], tuple[int, dict[str, str], bytes]]:
    return lambda up: (status, headers or {}, body)


async def test_request_shape(upstreams: Callable[..., Any]) -> None:
    up = await upstreams()
    up.answer = answering(200, b"{}")
    pool = UpstreamPool(make_spec(up.url + "/", api_key="sk-up"))
    await pool.start()
    response = await pool.send("/chat/completions", BODY, {"Accept": "text/event-stream"})
    assert await response.aread() == b"{}"
    ((path, headers, body),) = up.posts
    assert (path, body) == ("/v1/chat/completions", BODY)
    assert headers["authorization"] == "Bearer sk-up"
    assert headers["x-api-key"] == "sk-up"
    assert headers["accept-encoding"] == "identity"
    assert headers["content-type"] == "application/json"
    assert headers["accept"] == "text/event-stream"
    assert headers["host"] == f"127.0.0.1:{up.port}"
    assert up.gets[0][0] == "/v1/models"
    assert up.gets[0][1]["authorization"] == "Bearer sk-up"
    await pool.close()


async def test_mounted_under_a_path(upstreams: Callable[..., Any]) -> None:
    """A replica URL with a path (a server behind a reverse proxy's prefix) keeps it."""
    up = await upstreams()
    pool = UpstreamPool(make_spec(up.url + "/llm"))
    await pool.start()
    assert up.gets[0][0] == "/llm/v1/models"
    async with await pool.send("/chat/completions", BODY):
        pass
    assert up.posts[0][0] == "/llm/v1/chat/completions"
    await pool.close()


async def test_a_header_with_a_line_break_is_refused(upstreams: Callable[..., Any]) -> None:
    up = await upstreams()
    pool = UpstreamPool(make_spec(up.url))
    with pytest.raises(ValueError, match="line break"):
        await pool.send("/chat/completions", BODY, {"accept": "a\r\nx-evil: 1"})
    assert up.posts == []
    await pool.close()


async def test_500_fails_over_503_is_busy(upstreams: Callable[..., Any]) -> None:
    a, b = await upstreams(), await upstreams()
    a.answer, b.answer = answering(500), answering(200)
    pool = UpstreamPool(make_spec(a.url, b.url))
    await pool.start()
    response = await pool.send("/chat/completions", BODY)
    assert (response.status, response.replica) == (200, b.url)
    await response.aclose()
    status = pool.status()[0]
    assert (status.state, status.last_error, status.outstanding) == (
        "down",
        f"{a.url} answered 500",
        0,
    )
    assert (len(a.posts), len(b.posts)) == (1, 1)
    # A 503 is busy, not down: the other replica is tried and both stay usable.
    pool2 = UpstreamPool(make_spec(a.url, b.url))
    await pool2.start()
    a.answer = answering(503)
    response = await pool2.send("/chat/completions", BODY)
    assert (response.status, response.replica) == (200, b.url)
    await response.aclose()
    assert [s.state for s in pool2.status()] == ["healthy", "healthy"]
    assert [s.outstanding for s in pool2.status()] == [0, 0]
    await pool.close()
    await pool2.close()


async def test_busy_everywhere_returns_last_busy_answer(upstreams: Callable[..., Any]) -> None:
    a, b = await upstreams(), await upstreams()
    a.answer = answering(429, b'{"host": "a"}', {"retry-after": "3"})
    b.answer = answering(429, b'{"host": "b"}', {"retry-after": "7"})
    pool = UpstreamPool(make_spec(a.url, b.url))
    await pool.start()
    response = await pool.send("/chat/completions", BODY)
    last = response.replica
    assert response.status == 429
    assert response.headers["retry-after"] == ("7" if last == b.url else "3")
    assert json.loads(await response.aread()) == {"host": "b" if last == b.url else "a"}
    assert (len(a.posts), len(b.posts)) == (1, 1)
    assert [s.outstanding for s in pool.status()] == [0, 0]
    assert pool.state() == "healthy"
    await pool.close()


async def test_4xx_is_returned_not_failed_over(upstreams: Callable[..., Any]) -> None:
    a, b = await upstreams(), await upstreams()
    a.answer = b.answer = answering(400, b'{"error": {}}')
    pool = UpstreamPool(make_spec(a.url, b.url))
    await pool.start()
    response = await pool.send("/chat/completions", BODY)
    assert response.status == 400 and len(a.posts) + len(b.posts) == 1
    await response.aclose()
    await pool.close()


async def test_all_down_unavailable_retry_after() -> None:
    dead = (closed_url(), closed_url())
    pool = UpstreamPool(make_spec(*dead))
    await pool.start()
    assert pool.state() == "down"
    assert pool.status()[0].last_error == f"{dead[0]} refused the connection"
    with pytest.raises(UpstreamUnavailable) as exc:
        await pool.send("/chat/completions", BODY)
    waits = [s.next_check_in for s in pool.status()]
    assert all(w is not None for w in waits)
    assert exc.value.retry_after == max(1, int(-(-min(w or 0 for w in waits) // 1)))
    await pool.close()


async def test_timeout_is_typed(upstreams: Callable[..., Any]) -> None:
    up = await upstreams()
    up.chat = "stall"
    pool = UpstreamPool(make_spec(up.url, timeout=0.3))
    await pool.start()
    with pytest.raises(UpstreamTimeout) as exc:
        await pool.send("/chat/completions", BODY)
    assert exc.value.message == f"upstream 'gpu-box': {up.url} sent nothing for 0.3 s"
    assert isinstance(exc.value.__cause__, wire.ReadTimeout)
    await pool.close()


async def test_least_outstanding_then_round_robin(upstreams: Callable[..., Any]) -> None:
    ups = [await upstreams() for _ in range(3)]
    for up in ups:
        up.answer = answering(200, b"ok")
    urls = tuple(up.url for up in ups)
    pool = UpstreamPool(make_spec(*urls))
    await pool.start()
    held = [await pool.send("/chat/completions", BODY) for _ in range(3)]
    assert sorted(r.replica for r in held) == sorted(urls)  # one each
    await held[1].aclose()
    extra = await pool.send("/chat/completions", BODY)
    assert extra.replica == held[1].replica  # the only one with nothing outstanding
    assert sorted(s.outstanding for s in pool.status()) == [1, 1, 1]
    for r in [*held, extra]:
        await r.aclose()
    picks = []
    for _ in range(6):
        async with await pool.send("/chat/completions", BODY) as r:
            picks.append(r.replica)
    assert sorted(picks) == sorted(urls * 2)  # ties take turns
    await pool.close()


async def test_bad_listing_is_down_then_recovers(upstreams: Callable[..., Any]) -> None:
    up = await upstreams(("m9",))
    up.listing = b"<html>"
    pool = UpstreamPool(make_spec(up.url))
    await pool.start()
    assert pool.status()[0].state == "down"
    assert pool.status()[0].last_error == "answered GET /v1/models with what is not JSON"
    assert pool.models() == ()
    up.listing = None
    await wait_for(lambda: pool.status()[0].state == "healthy")
    assert pool.models() == ("m9",)
    assert pool.status()[0].failures == 0
    await pool.close()
    assert all(s.next_check_in is None for s in pool.status())
