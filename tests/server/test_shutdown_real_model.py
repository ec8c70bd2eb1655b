"""SIGTERM is graceful: running streams get ``--shutdown-grace`` seconds to finish.

Each test starts its own ``sluice serve`` process on the real model and signals it
mid-stream. SmolLM2 with one thread makes roughly 30-100 tokens/s here, so a
stream's length (``max_tokens`` with ``ignore_eos``) says how long it runs.
(``--shutdown-grace 0``, today's immediate error frame, is tested in
test_disconnect_real_model.py.)
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.real_server import QUIET, data_chunks, parse_sse
from tests.support.servers import serve_process_handle

pytestmark = pytest.mark.integration

SERVER = (*QUIET, "--parallel", "2", "--ctx", "1024")
CHAT = "/v1/chat/completions"
EXIT_CODES = (0, -signal.SIGTERM, 130)  # uvicorn re-raises the signal it handled


def story(max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


@dataclass
class Timeline:
    """Each SSE frame with its arrival, in seconds after the (first) SIGTERM."""

    frames: list[tuple[float, bytes]]
    signalled: float  # time.monotonic() of the SIGTERM

    def since(self, start: float, end: float = float("inf")) -> int:
        """Data frames that arrived in [start, end) seconds after the SIGTERM."""
        return sum(1 for t, f in self.frames if start <= t < end and f.startswith(b"data: {"))

    @property
    def body(self) -> bytes:
        return b"".join(f for _, f in self.frames)

    @property
    def last(self) -> tuple[float, bytes]:
        return self.frames[-1]


def stream_and_signal(
    url: str,
    proc: subprocess.Popen[bytes],
    body: dict[str, Any],
    *,
    after: int = 5,
    on_frame: Callable[[float], None] | None = None,
) -> Timeline:
    """Stream ``body``; SIGTERM the server once ``after`` data frames have arrived.

    ``on_frame(t)`` runs after every later frame, ``t`` seconds after the signal.
    """
    frames: list[tuple[float, bytes]] = []
    signalled: float | None = None
    buf = b""
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            buf += chunk
            *complete, buf = buf.split(b"\n\n")
            now = time.monotonic()
            for frame in complete:
                frames.append((now - signalled if signalled is not None else -1.0, frame + b"\n\n"))
            if signalled is None and sum(f.startswith(b"data: ") for _, f in frames) >= after:
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
            elif signalled is not None and on_frame is not None:
                on_frame(time.monotonic() - signalled)
    assert buf == b"", buf
    assert signalled is not None, "the stream ended before the signal"
    return Timeline(frames, signalled)


def exit_time(proc: subprocess.Popen[bytes], signalled: float, within: float) -> float:
    """Wait for the process to end; seconds from the SIGTERM to its exit."""
    proc.wait(within)
    assert proc.returncode in EXIT_CODES, proc.returncode
    return time.monotonic() - signalled


def assert_error_frame(frame: bytes) -> None:
    assert frame.startswith(b"event: error\ndata: "), frame
    payload = json.loads(frame.split(b"data: ", 1)[1])
    assert payload["code"] == "shutting_down" and payload["error"]["type"] == "server_error"


def test_a_stream_that_ends_within_the_grace_finishes_normally() -> None:
    with serve_process_handle(*SERVER, "--shutdown-grace", "30") as (url, proc):
        timeline = stream_and_signal(url, proc, story(60))
        exited = exit_time(proc, timeline.signalled, within=20)
    chunks = data_chunks(parse_sse(timeline.body))  # no error frame, one [DONE] at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert timeline.since(0) > 10, "generation went on after the signal"
    # The process does not wait out the grace: it exits once the stream is done.
    assert exited - timeline.last[0] < 5, (exited, timeline.last[0])


def test_a_stream_that_outlasts_the_grace_gets_the_error_frame_at_the_grace() -> None:
    grace = 3.0
    probes: list[str] = []
    with serve_process_handle(*SERVER, "--shutdown-grace", str(grace)) as (url, proc):
        # A keep-alive connection, open and idle when the signal arrives.
        addr = urlsplit(url)
        idle = socket.create_connection((addr.hostname, addr.port), timeout=10)

        def new_requests(t: float) -> None:
            if not probes:
                # At once: the app answers 503 shutting_down, unless uvicorn (on its next
                # tick, within 0.1 s of the signal) has already closed the connection.
                probes.append(_request_on(idle))
            elif len(probes) == 1 and t > 0.5:
                # During the grace, uvicorn no longer accepts connections.
                with pytest.raises(httpx.ConnectError):
                    httpx.post(url + CHAT, json=story(4), timeout=5)
                probes.append("refused")

        timeline = stream_and_signal(url, proc, story(900), on_frame=new_requests)
        exited = exit_time(proc, timeline.signalled, within=grace + 15)
        idle.close()
    assert probes[0] in ("503 shutting_down", "closed"), probes
    assert probes[1:] == ["refused"]
    at, last = timeline.last
    assert_error_frame(last)
    assert b"data: [DONE]" not in timeline.body
    assert grace - 0.5 < at < grace + 2, at  # ended at the grace, not at the signal
    assert timeline.since(0, grace - 0.5) > 10, "generation went on during the grace"
    assert exited < grace + 4, exited


def _request_on(sock: socket.socket) -> str:
    payload = json.dumps(story(4)).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    try:
        sock.sendall(head + payload)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    if not answer:
        return "closed"
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b'"code":"shutting_down"' in answer, answer
    return "503 shutting_down"


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_ends_the_streams_at_once(second: signal.Signals) -> None:
    sent: list[float] = []
    with serve_process_handle(*SERVER, "--shutdown-grace", "60") as (url, proc):

        def second_signal(t: float) -> None:
            if not sent and t > 1.0:
                proc.send_signal(second)
                sent.append(t)

        timeline = stream_and_signal(url, proc, story(900), on_frame=second_signal)
        exited = exit_time(proc, timeline.signalled, within=30)
    assert sent, "the stream ended before the second signal"
    at, last = timeline.last
    assert_error_frame(last)
    assert timeline.since(0, sent[0]) > 5, "the first signal did not end the stream"
    assert sent[0] <= at < sent[0] + 2, (sent[0], at)
    assert exited < sent[0] + 4, (sent[0], exited)
