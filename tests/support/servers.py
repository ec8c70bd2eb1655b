"""Real servers for tests: uvicorn on a free loopback port, in a thread or a process."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Run an ASGI app (lifespan included) on real HTTP in a background thread."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start `sluice serve` as a real process (the README's command) and wait for /health."""
    with serve_process_handle(*args, env=env) as (base, _proc):
        yield base


@contextlib.contextmanager
def serve_process_handle(
    *args: str, env: dict[str, str] | None = None, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`serve_process`, also giving the process (to signal it); on ``port``, or a
    free one."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(port), *args]
    # Output goes to a file, not a pipe nobody drains (a full pipe would block the server).
    log_file = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    # An empty models folder and a store of its own unless the test gives them: the
    # user's own models and conversations stay out, and two servers share nothing.
    empty = tempfile.TemporaryDirectory()  # cleaned up in the finally below
    full_env = {
        **os.environ,
        "SLUICE_MODELS_DIR": empty.name,
        "SLUICE_STORE": os.path.join(empty.name, "store.db"),
        **(env or {}),
    }
    proc = subprocess.Popen(cmd, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                log_file.seek(0)
                out = log_file.read().decode(errors="replace")
                raise RuntimeError(f"sluice exited with {proc.returncode}:\n{out}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("sluice did not become healthy")
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
        empty.cleanup()


def health_gaps_during(base: str, send: Any, settle: float = 0.2) -> tuple[Any, list[float]]:
    """Run ``send()`` while polling ``/health`` every 5 ms from another thread.

    Returns what ``send()`` returned and the gaps between consecutive /health
    answers (the longest is how long the server could not answer).
    """
    gaps: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            last = time.monotonic()
            while not stop.is_set():
                assert client.get("/health").status_code == 200
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(settle)
    try:
        result = send()
    finally:
        time.sleep(settle)
        stop.set()
        poller.join(30)
    return result, gaps


def slow_socket(base: str, path: str, body: dict[str, Any], timeout: float = 10) -> socket.socket:
    """POST on a socket that takes little, and ``Connection: close`` (the response
    ends with EOF); the response is left unread.

    A small receive buffer keeps the window small; a small MSS keeps the server's
    send buffer small too (Linux sizes it from the MSS, 64 KB on loopback, which
    would let ~3 MB queue in the kernel before the server's writes block).
    """
    url = urlsplit(base)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(timeout)
    sock.connect((url.hostname, url.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


@contextlib.contextmanager
def http_server(
    handle: Callable[[BaseHTTPRequestHandler], None], *, tls: ssl.SSLContext | None = None
) -> Iterator[str]:
    """A real threaded HTTP/1.1 server on 127.0.0.1 whose GETs go to ``handle``.

    Yields its base URL (``http://127.0.0.1:<port>``, ``https://`` with ``tls``, a
    server context); stops it on exit.
    """

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            handle(self)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    if tls is not None:  # the handshake runs in each request's thread, on first read
        httpd.socket = tls.wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


MCP_TEST_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcp_server.py")


@contextlib.contextmanager
def mcp_http_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """The MCP test server (``mcp_server.py`` here) over streamable HTTP; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, MCP_TEST_SERVER, "http", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, "the MCP test server exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the MCP test server did not start"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def gateway_in_front(url: str, *, native_apis: tuple[str, ...] = ()) -> Iterator[str]:
    """A second ``sluice serve`` whose only models are ``url``'s ``smollm2``: slot ``up``
    (alias ``up-smollm2``, translated from OpenAI chat) and, with ``native_apis``, slot
    ``native`` (alias ``native-smollm2``) that speaks those dialects itself."""
    lines = [
        "[[upstreams]]",
        'name = "up"',
        f'url = "{url}"',
        'models = ["smollm2"]',
        'aliases = { "up-smollm2" = "smollm2" }',
    ]
    if native_apis:
        lines += [
            "[[upstreams]]",
            'name = "native"',
            f'url = "{url}"',
            'models = ["smollm2"]',
            'aliases = { "native-smollm2" = "smollm2" }',
            f"native_apis = {json.dumps(list(native_apis))}",
        ]
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "sluice.toml")
        with open(config, "w") as f:
            f.write("\n".join(lines) + "\n")
        with serve_process("--config", config, "--log-level", "warning", "--threads", "1") as base:
            yield base
