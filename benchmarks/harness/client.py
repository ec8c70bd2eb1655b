"""The benchmarks' HTTP client: one blocking socket and one thread per stream.

A blocking ``recv`` per chunk is the cheapest client there is in Python (no event loop
between the kernel and the timestamp): on a 2-core machine every microsecond the client
spends is taken from the server under test. Connections are opened before the clock
starts. It speaks plain HTTP/1.1 to any OpenAI-compatible server (sluice, llama-server,
LiteLLM), so every side of a comparison is driven by the same code.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness import prog
from harness.machine import proc_cpu_seconds

CHAT = "/v1/chat/completions"
CONTENT = re.compile(rb'"content":"[^"]')  # a chunk with non-empty content
TEXT = re.compile(rb'"text":"[^"]')  # a /v1/completions chunk with non-empty text
DELTA = b'"delta":{"content"'  # a chat content frame, counted per read
DELTA_RE = re.compile(re.escape(DELTA))


@dataclass
class Stream:
    """One streaming request: when it was sent, its first content, ``[DONE]``; the bytes."""

    t_send: float = 0.0
    t_first: float = 0.0  # first content
    t_done: float = 0.0  # [DONE] received
    raw: bytearray = field(default_factory=bytearray)
    reads: list[tuple[float, int]] = field(default_factory=list)  # (time, content frames)

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_send

    def _head(self) -> list[str]:
        return bytes(self.raw).partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")

    @property
    def status(self) -> int:
        """The HTTP status (0 before a status line arrived)."""
        line = self._head()[0]
        return int(line.split()[1]) if line.startswith("HTTP/") else 0

    @property
    def headers(self) -> dict[str, str]:
        return {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in self._head()[1:])}

    def body(self) -> bytes:
        """The response body, de-chunked."""
        return body_of(bytes(self.raw))

    def parse(self) -> dict[str, Any]:
        return parse_sse(bytes(self.raw))


def dechunk(body: bytes) -> bytes:
    """A ``Transfer-Encoding: chunked`` body, decoded."""
    out = bytearray()
    i = 0
    while i < len(body):
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            break
        out += body[j + 2 : j + 2 + size]
        i = j + 2 + size + 2
    return bytes(out)


def body_of(raw: bytes) -> bytes:
    head, _, body = raw.partition(b"\r\n\r\n")
    return dechunk(body) if b"transfer-encoding: chunked" in head.lower() else body


def parse_sse(raw: bytes) -> dict[str, Any]:
    """Status, text (chat content or completion text), usage, llama-server's timings, the
    number of choice frames and the finish reason of a raw SSE response."""
    head = raw.partition(b"\r\n\r\n")[0]
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    text: list[str] = []
    usage = timings = finish = None
    frames = 0
    for line in body_of(raw).split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        obj = json.loads(line[6:])
        usage = obj.get("usage") or usage
        timings = obj.get("timings") or timings
        for ch in obj.get("choices") or ():
            frames += 1
            text.append((ch.get("delta") or {}).get("content") or ch.get("text") or "")
            finish = ch.get("finish_reason") or finish
    return {
        "status": status,
        "text": "".join(text),
        "usage": usage,
        "timings": timings,
        "frames": frames,
        "finish": finish,
    }


def http_post(port: int, path: str, body: bytes, key: str | None = None) -> bytes:
    """A streaming POST (``Connection: close``: the answer ends with EOF)."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key else "")
        + "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_stream(
    sock: socket.socket,
    req: bytes,
    res: Stream,
    *,
    first: re.Pattern[bytes] = CONTENT,
    count: bytes | None = None,
    start: threading.Event | None = None,
    stop: threading.Event | None = None,
    on_first: Callable[[], object] | None = None,
) -> None:
    """Send ``req`` (once ``start`` is set) and read the answer to ``[DONE]`` (or EOF, or
    until ``stop`` is set). ``first`` marks the first content; ``count`` is counted per
    read into ``res.reads``; ``on_first()`` is called at the first content."""
    tail = b""
    if start is not None:
        start.wait()
    res.t_send = time.perf_counter()
    try:
        sock.sendall(req)
        while data := sock.recv(65536):
            now = time.perf_counter()
            res.raw += data
            if count is not None and (k := data.count(count)):
                res.reads.append((now, k))
            if not res.t_first and first.search(tail + data):
                res.t_first = now
                if on_first is not None:
                    on_first()
            if b"data: [DONE]" in tail + data:
                res.t_done = now
                break
            if stop is not None and stop.is_set():
                break
            tail = data[-64:]
    except OSError:
        if stop is None or not stop.is_set():
            raise
    finally:
        sock.close()


def send(port: int, path: str, body: bytes, first: re.Pattern[bytes] = CONTENT) -> Stream:
    """One streaming request (connected before the clock), read to its end."""
    sock, res = connect(port), Stream()
    read_stream(sock, http_post(port, path, body), res, first=first)
    return res


def run_streams(
    port: int,
    reqs: list[bytes],
    *,
    first: re.Pattern[bytes] = CONTENT,
    count: bytes | None = None,
    lead: float = 0.05,
) -> list[Stream]:
    """Send ``reqs`` at once, ``lead`` s after their threads started; wait for all."""
    start = threading.Event()
    results = [Stream() for _ in reqs]
    socks = [connect(port) for _ in reqs]  # connections open before the clock starts
    kw = {"first": first, "count": count, "start": start}
    threads = [
        threading.Thread(target=read_stream, args=(s, q, r), kwargs=kw, daemon=True)
        for s, q, r in zip(socks, reqs, results)
    ]
    for t in threads:
        t.start()
    time.sleep(lead)
    start.set()
    for t in threads:
        t.join(900)
    return results


def run_staggered(
    port: int,
    plan: list[tuple[float, bytes]],
    *,
    first: re.Pattern[bytes] = CONTENT,
    count: bytes | None = None,
) -> list[Stream]:
    """Each request of ``plan`` sent at its offset (s) from a common start; wait for all."""
    socks = [connect(port) for _ in plan]  # connected before the clock
    results = [Stream() for _ in plan]
    t0 = time.perf_counter() + 0.05

    def one(i: int) -> None:
        delay = t0 + plan[i][0] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        read_stream(socks[i], plan[i][1], results[i], first=first, count=count)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(plan))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return results


def chat_stream_body(conversation: list[dict[str, str]], tokens: int) -> bytes:
    """The request of the throughput runs: streaming chat, greedy, ``ignore_eos``, usage
    at the end."""
    return json.dumps(
        {
            "model": "smollm2",
            "messages": conversation,
            "stream": True,
            "temperature": 0,
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


class Target(Protocol):
    port: int
    pid: int


def run_chat_streams(
    server: Target, conversations: list[list[dict[str, str]]], tokens: int
) -> dict[str, Any]:
    """The conversations as concurrent streams (``chat_stream_body``): throughput, TTFT,
    CPU time of the server, of its main thread (sluice's event loop) and of this client.

    * ``agg_tok_s``: completion tokens / wall time (first request sent -> last [DONE]);
    * ``decode_tok_s``: tokens after the first / time after the first, summed over streams;
    * ``steady_decode_tok_s``: content frames per second while every stream generates
      (after the last first token, before the first stream ends).
    """
    port, pid = server.port, server.pid
    reqs = [http_post(port, CHAT, chat_stream_body(c, tokens)) for c in conversations]
    srv_cpu0 = proc_cpu_seconds(pid)
    loop_cpu0 = proc_cpu_seconds(pid, pid)  # the main thread: asyncio loop, HTTP, SSE
    cli_cpu0 = time.process_time()
    results = run_streams(port, reqs, first=DELTA_RE, count=DELTA)
    srv_cpu = proc_cpu_seconds(pid) - srv_cpu0
    loop_cpu = proc_cpu_seconds(pid, pid) - loop_cpu0
    cli_cpu = time.process_time() - cli_cpu0
    parsed = [r.parse() for r in results]
    for r, p in zip(results, parsed):
        if not r.t_first or not r.t_done or p["usage"] is None:
            raise SystemExit(f"{prog()}: a stream did not complete: {bytes(r.raw[:400])!r}")
    n = len(results)
    comp = [p["usage"]["completion_tokens"] for p in parsed]
    wall = max(r.t_done for r in results) - min(r.t_send for r in results)
    ttfts = [r.t_first - r.t_send for r in results]
    per_stream_dec = [(c - 1) / (r.t_done - r.t_first) for c, r in zip(comp, results)]
    t1 = max(r.t_first for r in results)
    t2 = min(max(t for t, _ in r.reads) for r in results)
    in_window = sum(k for r in results for t, k in r.reads if t1 < t <= t2)
    steady = in_window / (t2 - t1) if t2 > t1 else float("nan")
    return {
        "n": n,
        "completion_tokens": comp,
        "prompt_tokens": [p["usage"]["prompt_tokens"] for p in parsed],
        "cached_tokens": [
            (p["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for p in parsed
        ],
        "wall_s": wall,
        "agg_tok_s": sum(comp) / wall,
        "decode_tok_s": sum(per_stream_dec),
        "steady_decode_tok_s": steady,
        "steady_window_s": t2 - t1,
        "ttft_s": ttfts,
        "frames": [p["frames"] for p in parsed],
        "finish": [p["finish"] for p in parsed],
        "server_cpu_s": srv_cpu,
        "server_loop_thread_cpu_s": loop_cpu,
        "client_cpu_s": cli_cpu,
        "texts": [p["text"] for p in parsed],
    }
