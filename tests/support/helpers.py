"""The real app on a scripted runner over real HTTP, a strict SSE reader, polling."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from sluice.config import Settings
from sluice.engine.engine import Engine
from sluice.server.app import create_app
from tests.support.fakes import ScriptedRunner, chat_prompt
from tests.support.servers import serve_app

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def _scripted_app(runner: ScriptedRunner, settings: dict[str, Any]) -> Any:
    settings.setdefault("model", "scripted")
    return create_app(Settings(**settings), runner_factory=lambda s: runner)


@contextlib.contextmanager
def scripted_server(runner: ScriptedRunner, **settings: Any) -> Iterator[str]:
    """The real app (engine, formatters, HTTP) around ``runner``, on real HTTP."""
    with serve_app(_scripted_app(runner, settings)) as base:
        yield base


@contextlib.contextmanager
def served(runner: ScriptedRunner, **settings: Any) -> Iterator[tuple[str, Engine]]:
    """:func:`scripted_server`, and its engine (for its stats and counters)."""
    app = _scripted_app(runner, settings)
    with serve_app(app) as base:
        yield base, app.state.sluice.registry.get_loaded(settings["model"]).engine


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def prompt_for(content: str) -> str:
    """The rendered prompt the fake sees for a single user message."""
    return chat_prompt(("user", content))


# -- SSE ------------------------------------------------------------------------


@dataclass
class SSEFrame:
    event: str | None
    data: str | None
    comments: list[str] = field(default_factory=list)

    def json(self) -> Any:
        assert self.data is not None
        return json.loads(self.data)


def parse_sse(body: bytes) -> list[SSEFrame]:
    """A strict reader: every frame ends with a blank line, every line is known."""
    text = body.decode("utf-8")  # strict: invalid UTF-8 on the wire raises
    assert text == "" or text.endswith("\n\n"), (
        f"body does not end with a blank line: {text[-80:]!r}"
    )
    frames: list[SSEFrame] = []
    for block in text.split("\n\n")[:-1]:
        assert block, "empty SSE block (two blank lines in a row)"
        frame = SSEFrame(None, None)
        for line in block.split("\n"):
            if line.startswith(":"):
                frame.comments.append(line)
            elif line.startswith("event: "):
                assert frame.event is None
                frame.event = line[len("event: ") :]
            elif line.startswith("data: "):
                assert frame.data is None, "multi-line data not expected"
                frame.data = line[len("data: ") :]
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        frames.append(frame)
    return frames


def data_frames(frames: list[SSEFrame]) -> list[SSEFrame]:
    return [f for f in frames if f.data is not None]


def chunks(frames: list[SSEFrame]) -> list[dict[str, Any]]:
    """JSON payloads of plain data frames, before [DONE]; asserts one [DONE] at the very end."""
    data = data_frames(frames)
    assert data, "no data frames"
    assert data[-1].data == "[DONE]" and data[-1].event is None
    assert [f.data for f in data].count("[DONE]") == 1
    assert all(f.event is None for f in data[:-1]), [f.event for f in data]
    return [f.json() for f in data[:-1]]


@dataclass
class StreamResult:
    status: int
    headers: httpx.Headers
    body: bytes

    @property
    def frames(self) -> list[SSEFrame]:
        return parse_sse(self.body)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return chunks(self.frames)


def post_stream(
    base: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 20,
) -> StreamResult:
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=timeout) as r:
        raw = r.read()
        return StreamResult(r.status_code, r.headers, raw)


def chat_text(chunk_list: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for ch in chunk_list
        for c in ch["choices"]
        if c["index"] == index
    )


def text_text(chunk_list: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(c["text"] for ch in chunk_list for c in ch["choices"] if c["index"] == index)


def finishes(chunk_list: list[dict[str, Any]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for ch in chunk_list:
        for c in ch["choices"]:
            if c["finish_reason"] is not None:
                out.setdefault(c["index"], []).append(c["finish_reason"])
    return out


# -- polling ---------------------------------------------------------------------


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def health(base: str) -> dict[str, Any]:
    r = httpx.get(base + "/health", timeout=5)
    assert r.status_code == 200
    return r.json()


def health_when(
    base: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 5.0
) -> dict[str, Any]:
    """Poll /health until ``pred(slots)`` holds; returns that /health body."""

    def check() -> dict[str, Any] | None:
        h = health(base)
        return h if pred(h["slots"]) else None

    result: dict[str, Any] = wait_until(check, timeout)
    return result


def wait_idle(base: str, timeout: float = 5.0) -> dict[str, Any]:
    """Poll /health until no slot is active and nothing is queued."""
    return health_when(base, lambda s: s["active"] == 0 and s["queued"] == 0, timeout)


# -- raw sockets (for disconnects: exact control over when the client goes away) ----


def raw_post(base: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a POST on a raw socket and return it, response unread."""
    url = urlsplit(base)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def read_until(sock: socket.socket, needle: bytes, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while needle not in buf:
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} not received; got {buf[-200:]!r}")
        data = sock.recv(65536)
        if not data:
            raise AssertionError(f"connection closed before {needle!r}; got {buf[-200:]!r}")
        buf += data
    return buf
