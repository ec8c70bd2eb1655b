"""Oversized request bodies get their 413 (OpenAI JSON), whatever the client does.

Real HTTP against the real app (scripted runner). The limit is the default
8 MiB, so the drain allowance is 32 MiB. After every test the same server
still answers a normal request (the autouse ``serves_after`` fixture).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from sluice.config import Settings
from sluice.server import body as body_module
from tests.support.fakes import ScriptedRunner
from tests.support.helpers import CHAT, scripted_server, user

LIMIT = Settings().max_body_bytes
ALLOWANCE = body_module.drain_allowance(LIMIT)
BIG = b"x" * (20 * 1024 * 1024)  # over the limit, within the drain allowance
NORMAL = {"messages": user("Hi"), "max_tokens": 8}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    assert LIMIT < len(BIG) < ALLOWANCE
    with scripted_server(ScriptedRunner()) as url:
        yield url


@pytest.fixture(autouse=True)
def serves_after(base: str) -> Iterator[None]:
    yield
    r = httpx.post(base + CHAT, json=NORMAL, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello world!"


def assert_413(status: int, payload: Any) -> None:
    assert status == 413
    error = payload["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "request_too_large"
    assert str(LIMIT) in error["message"]


# -- a raw client: exact control over what is sent and when it reads ---------------


@dataclass
class RawResponse:
    status_line: bytes
    headers: dict[str, str]
    body: bytes

    @property
    def status(self) -> int:
        return int(self.status_line.split()[1])

    def json(self) -> Any:
        return json.loads(self.body)


def connect(base: str) -> socket.socket:
    url = urlsplit(base)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def head(length: int | None, *extra: str, version: str = "HTTP/1.1") -> bytes:
    lines = [f"POST {CHAT} {version}", "Host: test", "Content-Type: application/json"]
    if length is None:
        lines.append("Transfer-Encoding: chunked")
    else:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode()


class Reader:
    """Reads HTTP/1.1 responses off a socket (Content-Length bodies only)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)  # a reset raises ConnectionResetError here
        if not data:
            raise AssertionError(f"connection closed mid-response; got {self.buf[:200]!r}")
        self.buf += data

    def head(self) -> tuple[bytes, dict[str, str]]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        raw, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *lines = raw.split(b"\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status_line, headers

    def response(self) -> RawResponse:
        status_line, headers = self.head()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return RawResponse(status_line, headers, body)

    def assert_eof(self, within: float = 5.0) -> None:
        """The server closed the connection cleanly (FIN, not RST, no more bytes)."""
        self.sock.settimeout(within)
        assert self.buf == b""
        assert self.sock.recv(65536) == b""


def normal_request() -> bytes:
    payload = json.dumps(NORMAL).encode()
    return head(len(payload)) + payload


# -- clients that send the whole body, then read --------------------------------


def test_httpx_content_length_body_gets_413_and_keeps_the_connection(base: str) -> None:
    with httpx.Client(base_url=base, timeout=30) as client:
        r = client.post(CHAT, content=BIG, headers={"content-type": "application/json"})
        assert_413(r.status_code, r.json())
        assert "20971520 bytes" in r.json()["error"]["message"]
        assert r.headers.get("connection") != "close"  # read to its end: still in step
        again = client.post(CHAT, json=NORMAL)
        assert again.status_code == 200


def test_chunked_body_over_the_limit_gets_413(base: str) -> None:
    def pieces() -> Iterator[bytes]:
        for _ in range(20):
            yield b"x" * (1024 * 1024)

    with httpx.Client(base_url=base, timeout=30) as client:
        r = client.post(CHAT, content=pieces(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_413(r.status_code, r.json())
        assert r.headers.get("connection") != "close"
        assert client.post(CHAT, json=NORMAL).status_code == 200


@pytest.mark.parametrize(
    ("extra", "version", "closes"),
    [
        ((), "HTTP/1.1", False),
        (("Connection: close",), "HTTP/1.1", True),
        ((), "HTTP/1.0", True),
    ],
    ids=["keep-alive", "connection-close", "http-1.0"],
)
def test_raw_client_that_sends_everything_then_reads_gets_the_413(
    base: str, extra: tuple[str, ...], version: str, closes: bool
) -> None:
    """Answering before the body is read, then closing, resets such a client."""
    with connect(base) as sock:
        sock.settimeout(30)
        sock.sendall(head(len(BIG), *extra, version=version) + BIG)
        reader = Reader(sock)
        resp = reader.response()
        assert resp.status_line.startswith(b"HTTP/1.1 413 "), resp.status_line
        assert resp.headers["content-type"] == "application/json"
        assert_413(resp.status, resp.json())
        if closes:
            reader.assert_eof()
        else:
            # the body was consumed: the next request on this connection is answered
            sock.sendall(normal_request())
            assert reader.response().status == 200


def test_urllib_client_gets_the_413(base: str) -> None:
    """urllib.request sends ``Connection: close`` and writes the whole body first."""
    req = urllib.request.Request(
        base + CHAT, data=BIG, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    assert_413(caught.value.code, json.loads(caught.value.read()))


# -- answered at once, with Connection: close ------------------------------------


def test_expect_100_continue_over_the_limit_is_answered_at_once(base: str) -> None:
    """No ``100 Continue``: a 413 that closes the connection (the body was never sent)."""
    with connect(base) as sock:
        sock.sendall(head(len(BIG), "Expect: 100-continue"))
        reader = Reader(sock)
        resp = reader.response()
        assert resp.status_line.startswith(b"HTTP/1.1 413 "), resp.status_line
        assert resp.headers["connection"] == "close"
        assert_413(resp.status, resp.json())
        reader.assert_eof()


def test_expect_100_continue_within_the_limit_gets_continue(base: str) -> None:
    payload = json.dumps(NORMAL).encode()
    with connect(base) as sock:
        sock.sendall(head(len(payload), "Expect: 100-continue"))
        reader = Reader(sock)
        status_line, _ = reader.head()
        assert status_line == b"HTTP/1.1 100 Continue"
        sock.sendall(payload)
        resp = reader.response()
        assert resp.status == 200
        assert resp.json()["choices"][0]["message"]["content"] == "Hello world!"


def test_declared_length_past_the_drain_allowance_is_answered_at_once(base: str) -> None:
    with connect(base) as sock:
        sock.sendall(head(ALLOWANCE + 1))  # and no body: the answer must not wait for it
        reader = Reader(sock)
        resp = reader.response()
        assert_413(resp.status, resp.json())
        assert resp.headers["connection"] == "close"
        reader.assert_eof()


def test_chunked_body_past_the_drain_allowance_gets_413_and_close(base: str) -> None:
    piece = 1024 * 1024
    assert ALLOWANCE % piece == 0
    frame = f"{piece:x}\r\n".encode() + b"x" * piece + b"\r\n"
    with connect(base) as sock:
        sock.settimeout(30)
        sock.sendall(head(None))
        for _ in range(ALLOWANCE // piece):  # exactly the allowance: still drained
            sock.sendall(frame)
        sock.sendall(b"1\r\nx\r\n")  # one byte past it, then the client stops sending
        reader = Reader(sock)
        resp = reader.response()
        assert_413(resp.status, resp.json())
        assert resp.headers["connection"] == "close"
        reader.assert_eof()


def test_a_stalled_oversized_body_gets_413_after_the_drain_time_bound(
    base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(body_module, "DRAIN_SECONDS", 0.5)
    with connect(base) as sock:
        sock.settimeout(30)
        sock.sendall(head(len(BIG)) + BIG[: LIMIT + 1024 * 1024])  # the rest never comes
        sent = time.monotonic()
        reader = Reader(sock)
        resp = reader.response()
        waited = time.monotonic() - sent
        assert_413(resp.status, resp.json())
        assert resp.headers["connection"] == "close"
        assert 0.3 < waited < 5, waited
        reader.assert_eof()
