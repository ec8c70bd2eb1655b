"""The router over real HTTP, against scripted upstreams on loopback: every fault.

The gateway is the real app (scripted local model) with ``[[upstreams]]``
pointing at small raw-socket servers that answer exactly as scripted: a good
stream, a refusal, a stall before the first byte, a drop mid-stream,
malformed SSE, 500 and 429.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.upstream.backend import Passthrough
from sluice.upstream.sse import SSEDecoder
from tests.support.fakes import ScriptedRunner
from tests.support.helpers import CHAT, parse_sse, scripted_server
from tests.support.servers import free_port, slow_socket

GOOD_EVENTS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
]


def sse_event(data: dict[str, Any] | str) -> bytes:
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(
            {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m1"}
            | data
        )
    )
    return f"data: {payload}\n\n".encode()


GOOD_STREAM = b"".join(sse_event(e) for e in GOOD_EVENTS) + b"data: [DONE]\n\n"
GOOD_BODY = json.dumps(
    {
        "id": "chatcmpl-up",
        "object": "chat.completion",
        "created": 1,
        "model": "m1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    },
    indent=1,  # not sluice's own formatting: proves the bytes are the upstream's
).encode()

# An upstream that speaks Anthropic's Messages itself (native_apis = ["anthropic"]).
ANTHROPIC_EVENTS = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_up",
            "type": "message",
            "role": "assistant",
            "model": "m1",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 0},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": 2, "cache_read_input_tokens": 3, "output_tokens": 2},
    },
    {"type": "message_stop"},
]


RESPONSES_EVENTS = [
    {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_up"}},
    {"type": "response.output_text.delta", "sequence_number": 1, "delta": "Hi", "logprobs": []},
    {
        "type": "response.completed",
        "sequence_number": 2,
        "response": {"id": "resp_up", "usage": {"input_tokens": 7, "output_tokens": 1}},
    },
]

# A Responses stream cut after two deltas (its replica died).
_UP_RESPONSE = {
    "id": "resp_up",
    "object": "response",
    "created_at": 1,
    "status": "in_progress",
    "model": "m1",
    "output": [],
    "usage": None,
    "store": False,
    "metadata": {"kept": "yes"},
}
_UP_MESSAGE = {"type": "message", "id": "msg_up", "status": "in_progress", "role": "assistant"}
_UP_PART = {"type": "output_text", "text": "", "annotations": []}
RESPONSES_DROPPED = [
    {"type": "response.created", "sequence_number": 0, "response": _UP_RESPONSE},
    {"type": "response.in_progress", "sequence_number": 1, "response": _UP_RESPONSE},
    {
        "type": "response.output_item.added",
        "sequence_number": 2,
        "output_index": 0,
        "item": _UP_MESSAGE | {"content": []},
    },
    {
        "type": "response.content_part.added",
        "sequence_number": 3,
        "item_id": "msg_up",
        "output_index": 0,
        "content_index": 0,
        "part": _UP_PART,
    },
    *(
        {
            "type": "response.output_text.delta",
            "sequence_number": 4 + i,
            "item_id": "msg_up",
            "output_index": 0,
            "content_index": 0,
            "delta": delta,
            "logprobs": [],
        }
        for i, delta in enumerate(("Hel", "lo "))
    ),
]

# An upstream that speaks Google's Gemini API itself (native_apis = ["gemini"]).
GEMINI_RECORDS = [
    {
        "candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}, "index": 0}],
        "responseId": "gem_up",
    },
    {
        "candidates": [
            {
                "content": {"role": "model", "parts": [{"text": "lo"}]},
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 6,
            "candidatesTokenCount": 2,
            "thoughtsTokenCount": 3,
        },
        "responseId": "gem_up",
    },
]


# An image, a transcription, an embedding: whatever it is, the bytes are the upstream's.
MEDIA_BODY = json.dumps({"data": [{"b64_json": "aGk=", "embedding": [0.5]}]}, indent=1).encode()


def gemini_event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\r\n\r\n".encode()  # Google's framing: CRLF


def anthropic_event(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


Behaviour = Callable[["Upstream", socket.socket, dict[str, Any]], None]


class Upstream:
    """A scripted OpenAI-compatible server on a real loopback socket."""

    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour
        self.posts: list[dict[str, Any]] = []
        self.disconnected = threading.Event()
        self.release = threading.Event()  # gemini_held: the rest of its array
        self.models_ok = True
        self.socks: set[socket.socket] = set()
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._serve(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kill(self) -> None:
        """Gone as a killed process is: no listener, every connection reset."""
        self.close()
        for sock in list(self.socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _serve(self, sock: socket.socket) -> None:
        self.socks.add(sock)
        reader = sock.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (h := reader.readline()) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = reader.read(int(headers.get("content-length", 0)))
                if method == "GET":
                    if not self.models_ok:
                        return  # close: the health check fails
                    self._respond(sock, 200, json.dumps({"data": [{"id": "m1"}]}).encode())
                    continue
                try:
                    parsed = json.loads(body)
                except ValueError:  # a multipart form (audio), kept as bytes
                    parsed = {}
                self.posts.append({"path": path, "headers": headers, "body": parsed, "raw": body})
                if not getattr(self, f"_{self.behaviour}")(sock, parsed):
                    return
        except OSError:
            return

    def _respond(
        self, sock: socket.socket, status: int, body: bytes, extra: str = "", ctype: str = "json"
    ) -> None:
        media = "application/json" if ctype == "json" else "text/event-stream"
        sock.sendall(
            f"HTTP/1.1 {status} X\r\nContent-Type: {media}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n".encode()
            + body
        )

    def _stream_head(self, sock: socket.socket) -> None:
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

    def _chunk(self, sock: socket.socket, data: bytes) -> None:
        sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    # -- behaviours: return True to keep the connection for another request ----------

    def _ok(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        if not body.get("stream"):
            self._respond(sock, 200, GOOD_BODY)
            return True
        self._stream_head(sock)
        for event in GOOD_STREAM.split(b"\n\n")[:-1]:
            self._chunk(sock, event + b"\n\n")
        sock.sendall(b"0\r\n\r\n")
        return True

    def _slow(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._stream_head(sock)
        try:
            for i in range(200):
                self._chunk(
                    sock, sse_event({"choices": [{"index": 0, "delta": {"content": f"{i}"}}]})
                )
                time.sleep(0.05)
        except OSError:
            self.disconnected.set()
        return False

    def _flood(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """Events of 1 KB as fast as the socket takes them: 8 MB in all."""
        self._stream_head(sock)
        event = sse_event({"choices": [{"index": 0, "delta": {"content": "x" * 1000}}]})
        try:
            for _ in range(8000):
                self._chunk(sock, event)
            self._chunk(sock, b"data: [DONE]\n\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            self.disconnected.set()
        return False

    def _held(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """The good stream, its end held until the test releases it (or 10 s)."""
        self._stream_head(sock)
        self._chunk(sock, sse_event(GOOD_EVENTS[0]))
        self.release.wait(10)
        for event in GOOD_EVENTS[1:]:
            self._chunk(sock, sse_event(event))
        self._chunk(sock, b"data: [DONE]\n\n")
        sock.sendall(b"0\r\n\r\n")
        return True

    def _resumable(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """A first request's stream dropped after "Hel", "lo " (a space last: held back
        from the continuation's prefix); a continuation's (``continue_final_message``)
        answered with " world" and its own id and usage."""
        self._stream_head(sock)
        if not body.get("continue_final_message"):
            for event in [
                *GOOD_EVENTS[:2],
                {"choices": [{"index": 0, "delta": {"content": "lo "}}]},
            ]:
                self._chunk(sock, sse_event(event))
            time.sleep(0.05)
            sock.shutdown(socket.SHUT_RDWR)
            return False
        other = {"id": "chatcmpl-other", "created": 2}
        for event in [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {
                "choices": [],
                "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
            },
        ]:
            self._chunk(sock, sse_event(event | other))
        self._chunk(sock, b"data: [DONE]\n\n")
        sock.sendall(b"0\r\n\r\n")
        return True

    def _responses_resumable(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """A Responses stream (``native_apis = ["responses"]``) dropped after "Hel",
        "lo "; its continuation, asked through OpenAI chat, as :meth:`_resumable`'s."""
        if self.posts[-1]["path"] != "/v1/responses":
            return self._resumable(sock, body)
        self._stream_head(sock)
        for event in RESPONSES_DROPPED:
            self._chunk(sock, anthropic_event(event))  # the same named-event framing
        time.sleep(0.05)
        sock.shutdown(socket.SHUT_RDWR)
        return False

    def _gemini_resumable(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """A Gemini SSE stream (``native_apis = ["gemini"]``) dropped after "Hel",
        "lo "; its continuation, asked through OpenAI chat, as :meth:`_resumable`'s."""
        if ":streamGenerateContent" not in self.posts[-1]["path"]:
            return self._resumable(sock, body)
        self._stream_head(sock)
        for text in ("Hel", "lo "):
            content = {"role": "model", "parts": [{"text": text}]}
            record = {"candidates": [{"content": content, "index": 0}], "responseId": "gem_up"}
            self._chunk(sock, gemini_event(record | {"modelVersion": "m1-001"}))
        time.sleep(0.05)
        sock.shutdown(socket.SHUT_RDWR)
        return False

    def _stall(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        time.sleep(3)
        return False

    def _drop(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._stream_head(sock)
        for event in GOOD_EVENTS[:2]:
            self._chunk(sock, sse_event(event))
        sock.shutdown(socket.SHUT_RDWR)
        return False

    def _malformed(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._stream_head(sock)
        self._chunk(sock, sse_event(GOOD_EVENTS[0]))
        self._chunk(sock, b"data: {this is not json\n\n")
        self._chunk(sock, b"data: [DONE]\n\n")
        sock.sendall(b"0\r\n\r\n")
        return True

    def _error500(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._respond(sock, 500, b'{"error": {"message": "boom", "type": "server_error"}}')
        return True

    def _busy429(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        err = b'{"error": {"message": "slow down", "type": "rate_limit_error"}}'
        self._respond(sock, 429, err, "Retry-After: 7\r\n")
        return True

    def _anthropic(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        if self.posts[-1]["path"].startswith("/v1/messages/count_tokens"):
            self._respond(sock, 200, b'{"input_tokens": 42}')
            return True
        self._stream_head(sock)
        for event in ANTHROPIC_EVENTS:
            self._chunk(sock, anthropic_event(event))
        sock.sendall(b"0\r\n\r\n")
        return True

    def _responses(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._stream_head(sock)
        for event in RESPONSES_EVENTS:
            self._chunk(sock, anthropic_event(event))  # the same named-event framing
        sock.sendall(b"0\r\n\r\n")
        return True

    def _gemini(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        path = self.posts[-1]["path"]
        if ":countTokens" in path:
            self._respond(sock, 200, b'{"totalTokens": 42}')
        elif "alt=sse" in path:
            self._stream_head(sock)
            for record in GEMINI_RECORDS:
                self._chunk(sock, gemini_event(record))
            sock.sendall(b"0\r\n\r\n")
        else:  # generateContent, or a stream as one JSON array
            records = GEMINI_RECORDS if ":stream" in path else GEMINI_RECORDS[-1]
            self._respond(sock, 200, json.dumps(records, indent=1).encode())
        return True

    def _gemini_held(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """A stream as one JSON array, sent in pieces: the first record, then (once the
        test releases it, or after 5 s) the others."""
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        first, *rest = (json.dumps(r).encode() for r in GEMINI_RECORDS)
        self._chunk(sock, b"[" + first)
        if self.behaviour == "gemini_cut":  # ends the body without closing the array
            sock.sendall(b"0\r\n\r\n")
            return True
        self.release.wait(5)
        for record in rest:
            self._chunk(sock, b",\r\n" + record)
        self._chunk(sock, b"]")
        sock.sendall(b"0\r\n\r\n")
        return True

    _gemini_cut = _gemini_held

    def _anthropic_drop(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._stream_head(sock)
        for event in ANTHROPIC_EVENTS[:3]:
            self._chunk(sock, anthropic_event(event))
        sock.shutdown(socket.SHUT_RDWR)
        return False

    def _anthropic_resumable(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """A first Messages stream dropped after "Hel", "lo " (its text block open); a
        continuation's (a prefilled assistant message last) answered with " world"
        under its own id and usage."""
        self._stream_head(sock)
        if body["messages"][-1]["role"] != "assistant":
            delta = {"type": "text_delta", "text": "lo "}
            for event in [
                *ANTHROPIC_EVENTS[:3],
                {"type": "content_block_delta", "index": 0, "delta": delta},
            ]:
                self._chunk(sock, anthropic_event(event))
            time.sleep(0.05)
            sock.shutdown(socket.SHUT_RDWR)
            return False
        start = json.loads(json.dumps(ANTHROPIC_EVENTS[0]))
        start["message"] |= {"id": "msg_other", "usage": {"input_tokens": 7, "output_tokens": 0}}
        for event in [
            start,
            {"type": "ping"},
            ANTHROPIC_EVENTS[1],
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": " world"},
            },
            ANTHROPIC_EVENTS[4],
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"input_tokens": 7, "output_tokens": 1},
            },
            ANTHROPIC_EVENTS[-1],
        ]:
            self._chunk(sock, anthropic_event(event))
        sock.sendall(b"0\r\n\r\n")
        return True

    def _anthropic_tool_drop(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        """A Messages stream dropped once a tool call began."""
        self._stream_head(sock)
        tool = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
        args = {"type": "input_json_delta", "partial_json": '{"a": '}
        for event in [
            *ANTHROPIC_EVENTS[:3],
            ANTHROPIC_EVENTS[4],
            {"type": "content_block_start", "index": 1, "content_block": tool},
            {"type": "content_block_delta", "index": 1, "delta": args},
        ]:
            self._chunk(sock, anthropic_event(event))
        time.sleep(0.05)
        sock.shutdown(socket.SHUT_RDWR)
        return False

    def _media(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        self._respond(sock, 200, MEDIA_BODY)
        return True

    def _bad_request(self, sock: socket.socket, body: dict[str, Any]) -> bool:
        err = b'{"error": {"message": "no such thing", "type": "invalid_request_error"}}'
        self._respond(sock, 400, err)
        return True


@contextlib.contextmanager
def upstreams(*behaviours: str) -> Iterator[list[Upstream]]:
    ups = [Upstream(b) for b in behaviours]
    try:
        yield ups
    finally:
        for u in ups:
            u.close()


@contextlib.contextmanager
def gateway(urls: list[str], **slot: Any) -> Iterator[str]:
    lines = ["[[upstreams]]", 'name = "up"', f"urls = {json.dumps(urls)}", 'models = ["m1"]']
    lines += ['aliases = { "alias-m1" = "m1" }']
    lines += [f"{k} = {json.dumps(v)}" for k, v in {"timeout": 1.0, **slot}.items()]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sluice.toml"
        config.write_text("\n".join(lines) + "\n")
        with scripted_server(ScriptedRunner(), config=str(config)) as base:
            yield base


def post(base: str, stream: bool = True, model: str = "m1", **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return httpx.post(f"{base}{CHAT}", json=body | extra, timeout=10)


def test_streaming_and_plain_answers_pass_through_unchanged() -> None:
    with upstreams("ok") as (up,), gateway([up.url]) as base:
        r = post(base)
        assert r.status_code == 200
        assert r.content == GOOD_STREAM
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-sluice-slot"] == f"up; replica={up.url}"
        r = post(base, stream=False)
        assert r.content == GOOD_BODY
        # The alias became the upstream's name, and nothing else changed.
        r = post(base, model="alias-m1", temperature=0.5, foo={"bar": [1, 2]})
        assert r.content == GOOD_STREAM
        assert up.posts[-1]["body"] == {
            "model": "m1",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "temperature": 0.5,
            "foo": {"bar": [1, 2]},
        }


def test_a_refused_replica_fails_over_to_the_next() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with upstreams("ok") as (up,), gateway([dead, up.url], health_interval=60) as base:
        for _ in range(3):
            r = post(base)
            assert r.content == GOOD_STREAM
            assert r.headers["x-sluice-slot"] == f"up; replica={up.url}"


def test_no_replica_left_is_a_502_and_all_down_a_503() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway([dead], health_interval=60) as base:
        # The first health check at start already found it down: 503 before any byte.
        r = post(base)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "upstream_unavailable"
        assert int(r.headers["retry-after"]) >= 1
    with upstreams("error500") as (up,), gateway([up.url]) as base:
        r = post(base)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_error"


def test_a_stall_before_the_first_byte_times_out_to_the_next_replica() -> None:
    with upstreams("stall", "ok") as (slow, up), gateway([slow.url, up.url]) as base:
        started = time.monotonic()
        statuses = {post(base).status_code for _ in range(2)}
        assert statuses == {200}
        assert time.monotonic() - started < 5
    with upstreams("stall") as (slow,), gateway([slow.url]) as base:
        r = post(base, stream=False)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_timeout"


def test_a_drop_mid_stream_ends_with_an_error_frame() -> None:
    with upstreams("drop") as (up,), gateway([up.url]) as base:
        r = post(base)
        assert r.status_code == 200
        frames = parse_sse(r.content)
        assert [f.event for f in frames] == [None, None, "error"]
        assert frames[-1].json()["error"]["code"] == "upstream_error"
        # Everything before the drop is the upstream's bytes.
        assert r.content.startswith(sse_event(GOOD_EVENTS[0]) + sse_event(GOOD_EVENTS[1]))


def test_malformed_sse_is_not_forwarded() -> None:
    with upstreams("malformed") as (up,), gateway([up.url]) as base:
        r = post(base)
        frames = parse_sse(r.content)
        assert [f.event for f in frames] == [None, "error"]
        assert frames[-1].json()["error"]["code"] == "upstream_malformed"
        assert b"not json" not in r.content.split(b"\n\n")[0]


def test_busy_replicas_pass_the_last_answer_on() -> None:
    with upstreams("busy429", "busy429") as ups, gateway([u.url for u in ups]) as base:
        r = post(base)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "7"
        assert r.json()["error"]["message"] == "slow down"
        assert sum(len(u.posts) for u in ups) == 2  # both were asked


def test_an_upstream_client_error_is_its_own_answer() -> None:
    # (Affinity off: the first replica, the one that refuses, is asked first.)
    with (
        upstreams("bad_request", "ok") as ups,
        gateway([u.url for u in ups], affinity=False) as base,
    ):
        r = post(base, stream=False)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "no such thing"
        assert sum(len(u.posts) for u in ups) == 1  # a 4xx is not retried elsewhere


def test_client_disconnect_closes_the_upstream_request() -> None:
    with upstreams("slow") as (up,), gateway([up.url]) as base:
        with httpx.stream(
            "POST",
            f"{base}{CHAT}",
            json={"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        ) as r:
            for _ in r.iter_raw():
                break
        assert up.disconnected.wait(3), "the upstream kept streaming to nobody"


def test_a_client_that_reads_nothing_pauses_the_upstream_then_is_dropped() -> None:
    """Events relayed straight from socket to socket: a client that stops reading pauses
    the upstream's socket (the gateway does not take 8 MB into memory for it), and after
    the stall timeout its request is dropped and the upstream request closed."""
    lines = ["[[upstreams]]", 'name = "up"', 'models = ["m1"]']
    with upstreams("flood") as (up,), tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sluice.toml"
        config.write_text("\n".join([*lines, f'urls = ["{up.url}"]']) + "\n")
        with scripted_server(ScriptedRunner(), config=str(config), stall_timeout=1.0) as base:
            body = {"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            sock = slow_socket(base, CHAT, body)
            try:
                assert up.disconnected.wait(15), "the upstream was read to its end"
            finally:
                sock.close()
            # The gateway goes on serving.
            assert httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_a_down_replica_takes_traffic_again_once_it_answers() -> None:
    # (Affinity off: its conversation would stay where it moved while 'a' was down.)
    with upstreams("ok", "ok") as (a, b):
        gw = gateway([a.url, b.url], health_interval=0.2, affinity=False)
        with gw as base:
            a.models_ok = False
            a.behaviour = "error500"
            post(base)  # whichever got it, 'a' is marked down by a 500 or its check
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and "down" not in _states(base):
                time.sleep(0.05)
            assert _states(base)[a.url] == "down"
            served_by_a = len(a.posts)
            for _ in range(4):
                assert post(base).status_code == 200
            assert len(a.posts) == served_by_a  # no traffic while down
            a.models_ok = True
            a.behaviour = "ok"
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and _states(base)[a.url] != "healthy":
                time.sleep(0.05)
            assert _states(base)[a.url] == "healthy"
            for _ in range(4):
                assert post(base).status_code == 200
            assert len(a.posts) > served_by_a


def _states(base: str) -> dict[str, str]:
    info = httpx.get(f"{base}/v1/info").json()
    entry = next(m for m in info["models"] if m["id"] == "m1")
    return {r["url"]: r["state"] for r in entry["backend"]["replicas"]}


def test_metrics_count_the_passthrough_stream() -> None:
    with upstreams("ok", "drop") as (good, bad):
        with gateway([good.url]) as base:
            for _ in range(2):
                post(base)
            slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
            assert slot["tokens_out"] == 4  # usage.completion_tokens, twice
            assert slot["tokens_in"] == 10
            assert slot["requests"] == 2 and slot["errors"] == 0
        with gateway([bad.url]) as base:
            post(base)
            slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
            assert slot["errors"] == 1


def test_sse_decoder_sees_whole_events_in_the_good_stream() -> None:
    # The scripted stream itself is well-formed SSE (guards the fixtures above).
    messages = SSEDecoder().feed(GOOD_STREAM)
    assert b"".join(m.raw for m in messages) == GOOD_STREAM
    assert messages[-1].data == "[DONE]"


@pytest.mark.parametrize("stream", [True, False])
def test_local_model_answers_name_their_slot(stream: bool) -> None:
    with gateway([f"http://127.0.0.1:{free_port()}"], health_interval=60) as base:
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        r = post(base, stream=stream, model="scripted", **extra)
        assert r.status_code == 200
        usage = parse_sse(r.content)[-2].json() if stream else r.json()
        completion_tokens = usage["usage"]["completion_tokens"]
        assert r.headers["x-sluice-slot"] == "scripted"
        # Measured on the same path as an upstream's: tokens out, one request, TTFT.
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["scripted"]
        assert slot["kind"] == "local" and slot["requests"] == 1
        assert slot["tokens_out"] == completion_tokens > 0
        assert slot["ttft_ms"]["last"] is not None
        health = httpx.get(f"{base}/health").json()
        assert health["upstreams"]["up"]["status"] == "down"


# -- Anthropic's Messages on upstreams ---------------------------------------------------

MESSAGES = {"model": "m1", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def anthropic_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in raw.split(b"\n\n")[:-1]:
        name, data = frame.split(b"\n")
        out.append((name.removeprefix(b"event: ").decode(), json.loads(data[6:])))
    return out


def test_messages_on_a_translated_upstream_drop_end_with_an_anthropic_error() -> None:
    with upstreams("drop") as (up,), gateway([up.url]) as base:
        r = httpx.post(f"{base}/v1/messages", json=MESSAGES | {"stream": True}, timeout=10)
    assert r.status_code == 200
    events = anthropic_events(r.content)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert events[-1][1]["error"]["type"] == "api_error"  # a 502 of the table
    assert up.posts[0]["path"] == "/v1/chat/completions"  # it went up as OpenAI chat


def test_messages_on_a_translated_upstream_keep_its_refusals() -> None:
    with upstreams("busy429") as (up,), gateway([up.url]) as base:
        busy = httpx.post(f"{base}/v1/messages", json=MESSAGES, timeout=10)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "7"
    assert busy.json() == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    with upstreams("bad_request") as (up,), gateway([up.url]) as base:
        bad = httpx.post(f"{base}/v1/messages", json=MESSAGES | {"stream": True}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "no such thing"


def test_a_native_upstream_gets_the_body_and_headers_and_is_metered() -> None:
    with upstreams("anthropic") as (up,), gateway([up.url], native_apis=["anthropic"]) as base:
        headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "x-2099", "x-api-key": "k"}
        body = MESSAGES | {"model": "alias-m1", "stream": True, "cache_control": {"type": "x"}}
        r = httpx.post(f"{base}/v1/messages?beta=true", json=body, headers=headers, timeout=10)
        counted = httpx.post(f"{base}/v1/messages/count_tokens", json=body, timeout=10)
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    assert r.status_code == 200
    assert r.content == b"".join(anthropic_event(e) for e in ANTHROPIC_EVENTS)
    assert counted.json() == {"input_tokens": 42}
    sent = up.posts[0]
    assert sent["path"] == "/v1/messages"
    # The body as the client wrote it, but for the upstream's own model name.
    assert sent["body"] == body | {"model": "m1"}
    assert sent["headers"]["anthropic-version"] == "2023-06-01"
    assert sent["headers"]["anthropic-beta"] == "x-2099"
    assert "x-api-key" not in sent["headers"]  # the client's key is not the upstream's
    assert up.posts[1]["path"] == "/v1/messages/count_tokens"
    # The tap read Anthropic's usage: 2 fresh + 3 cached in, 2 out.
    assert (slot["tokens_in"], slot["tokens_out"]) == (5, 2)


def test_a_native_upstream_drop_ends_with_an_anthropic_error() -> None:
    with (
        upstreams("anthropic_drop") as (up,),
        gateway([up.url], native_apis=["anthropic"]) as base,
    ):
        r = httpx.post(f"{base}/v1/messages", json=MESSAGES | {"stream": True}, timeout=10)
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    assert r.content.startswith(b"".join(anthropic_event(e) for e in ANTHROPIC_EVENTS[:3]))
    name, error = anthropic_events(r.content)[-1]
    assert name == "error" and error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert slot["errors"] == 1


def test_a_native_responses_upstream_gets_the_body_and_its_bytes_come_back() -> None:
    with upstreams("responses") as (up,), gateway([up.url], native_apis=["responses"]) as base:
        body = {"model": "alias-m1", "input": "hi", "stream": True, "client_metadata": {"x": 1}}
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=10)
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    assert r.status_code == 200
    assert r.content == b"".join(anthropic_event(e) for e in RESPONSES_EVENTS)
    # The tap read the Responses events: the terminal one ends it, with its usage.
    assert (slot["tokens_in"], slot["tokens_out"], slot["errors"]) == (7, 1, 0)
    assert up.posts[0]["path"] == "/v1/responses"
    assert up.posts[0]["body"] == body | {"model": "m1"}


def test_a_native_gemini_upstream_gets_the_body_and_its_bytes_come_back() -> None:
    with upstreams("gemini") as (up,), gateway([up.url], native_apis=["gemini"]) as base:
        body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "x_extra": {"a": 1}}
        key = {"x-goog-api-key": "client-key"}
        url = f"{base}/v1beta/models/alias-m1"
        sse = httpx.post(f"{url}:streamGenerateContent?alt=sse&key=k", json=body, timeout=10)
        array = httpx.post(f"{url}:streamGenerateContent", json=body, headers=key, timeout=10)
        whole = httpx.post(f"{base}/v1/models/alias-m1:generateContent", json=body, timeout=10)
        counted = httpx.post(
            f"{url}:countTokens",
            json={"generateContentRequest": {"model": "models/alias-m1"} | body},
            timeout=10,
        )
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
    assert sse.content == b"".join(gemini_event(r) for r in GEMINI_RECORDS)
    assert array.content == json.dumps(GEMINI_RECORDS, indent=1).encode()
    assert whole.content == json.dumps(GEMINI_RECORDS[-1], indent=1).encode()
    assert counted.json() == {"totalTokens": 42}
    paths = [p["path"] for p in up.posts]
    assert paths == [
        "/v1beta/models/m1:streamGenerateContent?alt=sse",  # the client's key is not sent
        "/v1beta/models/m1:streamGenerateContent",
        "/v1beta/models/m1:generateContent",
        "/v1beta/models/m1:countTokens",
    ]
    assert up.posts[0]["body"] == body  # as the client wrote it
    assert "x-goog-api-key" not in up.posts[1]["headers"]
    assert up.posts[3]["body"]["generateContentRequest"]["model"] == "models/m1"
    # The tap read Gemini's usage three times: 6 in, 2 answer + 3 thoughts out each.
    assert (slot["tokens_in"], slot["tokens_out"], slot["errors"]) == (18, 15, 0)


def test_a_native_gemini_array_stream_comes_through_as_it_is_sent() -> None:
    """streamGenerateContent without alt=sse is one JSON array: its first record reaches
    the client while the upstream still holds the rest, and the tap reads every record."""
    with (
        upstreams("gemini_held") as (up,),
        gateway([up.url], native_apis=["gemini"], timeout=10.0) as base,
    ):
        url = f"{base}/v1beta/models/alias-m1:streamGenerateContent"
        body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        started = time.monotonic()
        with httpx.stream("POST", url, json=body, timeout=10) as r:
            chunks = r.iter_raw()
            first = next(chunks)
            early = time.monotonic() - started
            up.release.set()
            content = first + b"".join(chunks)
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    assert early < 3, f"the first record came after {early:.1f} s: the array was held back"
    assert first.startswith(b"[") and r.headers["content-type"].startswith("application/json")
    assert json.loads(content) == GEMINI_RECORDS
    assert (slot["tokens_in"], slot["tokens_out"], slot["errors"]) == (6, 5, 0)


def test_a_native_gemini_array_cut_short_ends_with_an_error_record() -> None:
    with upstreams("gemini_cut") as (up,), gateway([up.url], native_apis=["gemini"]) as base:
        url = f"{base}/v1beta/models/alias-m1:streamGenerateContent"
        body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        r = httpx.post(url, json=body, timeout=10)
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    records = json.loads(r.content)  # still one valid array
    assert records[0] == GEMINI_RECORDS[0]
    assert "before finishing" in records[-1]["error"]["message"], records[-1]
    assert slot["errors"] == 1


def test_a_native_gemini_upstream_gets_the_slot_key() -> None:
    with (
        upstreams("gemini") as (up,),
        gateway([up.url], native_apis=["gemini"], api_key="slot-key") as base,
    ):
        body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
        r = httpx.post(f"{base}/v1beta/models/m1:generateContent", json=body, timeout=10)
    assert r.status_code == 200
    assert up.posts[0]["headers"]["x-goog-api-key"] == "slot-key"


def test_images_audio_rerank_and_embeddings_pass_through_to_an_upstream_model() -> None:
    with upstreams("media") as (up,), gateway([up.url]) as base:
        image = httpx.post(
            f"{base}/v1/images/generations",
            json={"model": "alias-m1", "prompt": "a fox", "stream": True},
            timeout=10,
        )
        assert image.status_code == 200 and image.content == MEDIA_BODY
        assert image.headers["x-sluice-slot"] == f"up; replica={up.url}"
        assert up.posts[-1]["path"] == "/v1/images/generations"
        assert up.posts[-1]["body"] == {"model": "m1", "prompt": "a fox", "stream": True}
        # A multipart form: the alias renamed, the file's bytes as sent.
        audio = b"RIFF\x00\x01fake-wave-bytes\xff"
        spoken = httpx.post(
            f"{base}/v1/audio/transcriptions",
            data={"model": "alias-m1", "language": "en"},
            files={"file": ("a.wav", audio, "audio/wav")},
            timeout=10,
        )
        assert spoken.status_code == 200 and spoken.content == MEDIA_BODY
        sent = up.posts[-1]
        assert sent["path"] == "/v1/audio/transcriptions"
        assert sent["headers"]["content-type"].startswith("multipart/form-data; boundary=")
        assert audio in sent["raw"] and b'name="model"\r\n\r\nm1\r\n' in sent["raw"]
        assert b"alias-m1" not in sent["raw"]
        for path in ("/v1/rerank", "/v1/embeddings"):
            r = httpx.post(f"{base}{path}", json={"model": "m1", "input": ["a"]}, timeout=10)
            assert r.status_code == 200 and r.content == MEDIA_BODY, path
            assert up.posts[-1]["path"] == path
        # Embeddings for an upstream are held to the same limits, before they leave.
        sent_before = len(up.posts)
        many = {"model": "alias-m1", "input": ["a"] * 2049}
        r = httpx.post(f"{base}/v1/embeddings", json=many, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert len(up.posts) == sent_before
        # A local model serves none of them; a missing model is the usual answer.
        local = httpx.post(
            f"{base}/v1/images/generations", json={"model": "scripted", "prompt": "x"}, timeout=10
        )
        assert local.status_code == 400 and local.json()["error"]["param"] == "model"
        assert "image generation" in local.json()["error"]["message"]
        missing = httpx.post(f"{base}/v1/audio/speech", json={"input": "hi"}, timeout=10)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def conversation(first: str, turns: int) -> list[dict[str, str]]:
    """A chat's messages at its ``turns``-th turn: a system prompt, then user/assistant."""
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages.append({"role": "user", "content": first if i == 0 else f"and then {i}?"})
        if i < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {i}"})
    return messages


def replica_of(response: httpx.Response) -> str:
    return response.headers["x-sluice-slot"].split("replica=")[1]


def test_a_conversation_stays_on_its_replica_and_conversations_spread() -> None:
    with (
        upstreams("ok", "ok", "ok") as ups,
        gateway([u.url for u in ups], health_interval=60) as base,
    ):
        homes: dict[str, set[str]] = {}
        for turn in range(1, 6):
            for n in range(12):
                first = f"question {n}"
                r = post(base, messages=conversation(first, turn))
                assert r.status_code == 200
                homes.setdefault(first, set()).add(replica_of(r))
        assert all(len(h) == 1 for h in homes.values())  # every turn where the first went
        assert len(set().union(*homes.values())) > 1
        # A session header wins over the prompt: two different prompts, one replica.
        seen = {
            replica_of(
                httpx.post(
                    f"{base}{CHAT}",
                    json={"model": "m1", "messages": conversation(f"q{i}", 1), "stream": True},
                    headers={"x-session-id": "agent-7"},
                    timeout=10,
                )
            )
            for i in range(8)
        }
        assert len(seen) == 1
        info = httpx.get(f"{base}/v1/info", timeout=10).json()
        (entry,) = [m for m in info["models"] if m["id"] == "m1"]
        affinity = entry["backend"]["affinity"]
        assert affinity["enabled"] is True and affinity["load_factor"] == 1.1
        assert affinity["conversations"] == 13
        assert affinity["choices"]["hashed"] == 13
        assert affinity["choices"]["pinned"] == 12 * 4 + 7
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'sluice_upstream_affinity_choices_total{choice="hashed",slot="up"} 13.0' in metrics
        assert 'sluice_upstream_affinity_conversations{slot="up"} 13.0' in metrics


def test_a_conversation_moves_when_its_replica_dies_and_stays_moved() -> None:
    with (
        upstreams("ok", "ok") as ups,
        gateway([u.url for u in ups], health_interval=60) as base,
    ):
        home = replica_of(post(base, messages=conversation("hello", 1)))
        (gone,) = [u for u in ups if u.url == home]
        gone.kill()
        moved = [replica_of(post(base, messages=conversation("hello", t))) for t in (2, 3, 4)]
        assert moved == [u.url for u in ups if u is not gone] * 3


def test_affinity_off_takes_turns() -> None:
    with (
        upstreams("ok", "ok") as ups,
        gateway([u.url for u in ups], health_interval=60, affinity=False) as base,
    ):
        seen = [replica_of(post(base, messages=conversation("same", 1))) for _ in range(4)]
        assert sorted(seen) == sorted([u.url for u in ups] * 2)
        info = httpx.get(f"{base}/v1/info", timeout=10).json()
        (entry,) = [m for m in info["models"] if m["id"] == "m1"]
        assert entry["backend"]["affinity"]["enabled"] is False


def test_thirty_conversations_at_once_spread_within_a_fifth() -> None:
    with (
        upstreams("held", "held", "held") as ups,
        gateway([u.url for u in ups], health_interval=60, timeout=20) as base,
    ):
        results: list[httpx.Response] = []

        def one(n: int) -> None:
            results.append(post(base, messages=conversation(f"conversation {n}", 3)))

        threads = [threading.Thread(target=one, args=(n,)) for n in range(30)]
        for t in threads:
            t.start()
            time.sleep(0.01)  # arriving one after another, all in flight together
        deadline = time.monotonic() + 10
        while sum(len(u.posts) for u in ups) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        spread = sorted(len(u.posts) for u in ups)
        for u in ups:
            u.release.set()
        for t in threads:
            t.join(20)
        assert all(r.status_code == 200 for r in results) and len(results) == 30
        assert spread[0] >= 8 and spread[-1] <= 12, spread  # 10 each, +-20 %


def test_a_stream_dropped_mid_answer_is_continued_by_another_replica() -> None:
    import openai

    with (
        upstreams("resumable", "resumable") as ups,
        gateway([u.url for u in ups], health_interval=60) as base,
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=50,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Hello world"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert [f for f in finishes if f] == ["stop"]
        assert {c.id for c in chunks} == {"chatcmpl-up"} and {c.created for c in chunks} == {1}
        usage = chunks[-1].usage
        assert usage is not None
        # The continuation's prompt held the two tokens already sent: moved to completion.
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 3, 10)
        _, second = sorted(ups, key=lambda u: len(u.posts[0]["body"]["messages"]))
        asked = second.posts[-1]["body"]
        assert asked["messages"][-1] == {"role": "assistant", "content": "Hello"}
        assert asked["continue_final_message"] is True
        assert asked["add_generation_prompt"] is False
        assert asked["max_tokens"] == 48


def test_a_dropped_answer_continues_through_anthropic_and_ollama() -> None:
    import anthropic
    import ollama

    with (
        upstreams("resumable", "resumable") as ups,
        gateway([u.url for u in ups], health_interval=60) as base,
    ):
        claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        with claude.messages.stream(
            model="m1", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == "Hello world"
        assert final.stop_reason == "end_turn"
        assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 3)
        parts = ollama.Client(host=base).chat(
            model="m1", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        pieces = list(parts)
        assert "".join(p.message.content or "" for p in pieces) == "Hello world"
        assert pieces[-1].done and pieces[-1].eval_count == 3


def test_no_continuation_without_another_replica_or_with_failover_off() -> None:
    with upstreams("resumable", "resumable") as ups:
        for urls, slot in (([ups[0].url], {}), ([u.url for u in ups], {"failover": False})):
            with gateway(urls, health_interval=60, **slot) as base:
                r = post(base)
                events = parse_sse(r.content)
                assert events[-1].event == "error", events[-1]
        assert not any(p["body"].get("continue_final_message") for u in ups for p in u.posts)


@pytest.mark.parametrize("relay", [True, False])
def test_a_native_messages_stream_dropped_mid_answer_is_continued(
    relay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anthropic

    if not relay:  # the task's stream (Passthrough.stream), as a server but uvicorn gets
        monkeypatch.setattr(Passthrough, "relayable", property(lambda self: False))
    with (
        upstreams("anthropic_resumable", "anthropic_resumable") as ups,
        gateway([u.url for u in ups], native_apis=["anthropic"], health_interval=60) as base,
    ):
        claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        with claude.messages.stream(
            model="m1", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == "Hello world"
    assert [b.text for b in final.content if b.type == "text"] == ["Hello world"]
    assert final.id == "msg_up" and final.stop_reason == "end_turn"
    assert [e.type for e in events].count("message_stop") == 1
    assert [e.type for e in events].count("message_start") == 1
    # The continuation's prompt held the two tokens already sent: they are output.
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 3)
    first, second = sorted(ups, key=lambda u: len(u.posts[-1]["body"]["messages"]))
    assert len(first.posts) == len(second.posts) == 1
    asked = second.posts[0]["body"]
    assert asked["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert asked["max_tokens"] == 48 and second.posts[0]["path"] == "/v1/messages"
    assert "continue_final_message" not in asked  # Anthropic's own prefill, nothing else
    # The tap read the spliced events: 5 in, 3 out, no error.
    assert (slot["tokens_in"], slot["tokens_out"], slot["errors"]) == (5, 3, 0)


def test_a_native_messages_stream_with_a_tool_call_or_failover_off_is_not_continued() -> None:
    cases = (("anthropic_tool_drop", {}), ("anthropic_resumable", {"failover": False}))
    for behaviour, slot in cases:
        with (
            upstreams(behaviour, behaviour) as ups,
            gateway(
                [u.url for u in ups], native_apis=["anthropic"], health_interval=60, **slot
            ) as base,
        ):
            body = MESSAGES | {"stream": True}
            r = httpx.post(f"{base}/v1/messages", json=body, timeout=10)
        name, error = anthropic_events(r.content)[-1]
        assert name == "error" and error["error"]["type"] == "api_error", behaviour
        posts = [p for u in ups for p in u.posts]
        assert len(posts) == 1, behaviour
        assert posts[0]["body"]["messages"][-1]["role"] == "user"


@pytest.mark.parametrize("relay", [True, False])
def test_a_native_responses_stream_dropped_mid_answer_is_continued_through_chat(
    relay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Responses API cannot continue an answer: the rest comes from another
    replica's OpenAI chat (the request as chat, the text so far to continue), written
    as the first stream's events: the open item's deltas, its done events, then
    response.completed with the first response's fields, the whole output and usage."""
    import openai

    if not relay:
        monkeypatch.setattr(Passthrough, "relayable", property(lambda self: False))
    with (
        upstreams("responses_resumable", "responses_resumable") as ups,
        gateway([u.url for u in ups], native_apis=["responses"], health_interval=60) as base,
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        events = list(
            client.responses.create(
                model="m1", input="hi", instructions="Be brief.", stream=True, max_output_tokens=50
            )
        )
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == "Hello world"
    assert {d.item_id for d in deltas} == {"msg_up"} and {d.output_index for d in deltas} == {0}
    done = events[-1].response  # type: ignore[union-attr]
    assert done.id == "resp_up" and done.status == "completed" and done.metadata == {"kept": "yes"}
    assert done.output_text == "Hello world" and done.output[0].id == "msg_up"
    assert done.usage is not None
    # The continuation's prompt held the two tokens already sent: they are output.
    assert (done.usage.input_tokens, done.usage.output_tokens) == (7, 3)
    first, second = sorted(ups, key=lambda u: u.posts[-1]["path"])
    assert [p["path"] for p in second.posts] == ["/v1/responses"]
    (asked,) = [p for p in first.posts]
    assert asked["path"] == "/v1/chat/completions"
    assert asked["body"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert asked["body"]["continue_final_message"] is True
    assert asked["body"]["max_tokens"] == 48 and asked["body"]["stream"] is True
    assert (slot["tokens_in"], slot["tokens_out"], slot["errors"]) == (7, 3, 0)


@pytest.mark.parametrize("relay", [True, False])
def test_a_native_gemini_stream_dropped_mid_answer_is_continued_through_chat(
    relay: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The google-genai SDK reads one answer: the first stream's records, then the
    continuation's (asked through OpenAI chat), with the first stream's responseId and
    modelVersion, one finish, and the whole answer's usage."""
    from google import genai
    from google.genai import types

    if not relay:
        monkeypatch.setattr(Passthrough, "relayable", property(lambda self: False))
    with (
        upstreams("gemini_resumable", "gemini_resumable") as ups,
        gateway([u.url for u in ups], native_apis=["gemini"], health_interval=60) as base,
    ):
        client = genai.Client(
            api_key="x", http_options=types.HttpOptions(base_url=base, api_version="v1beta")
        )
        config = types.GenerateContentConfig(max_output_tokens=50, system_instruction="Brief.")
        records = list(
            client.models.generate_content_stream(model="m1", contents="hi", config=config)
        )
        slot = httpx.get(f"{base}/v1/info").json()["slots"]["up"]
    assert "".join(r.text or "" for r in records) == "Hello world"
    assert {r.response_id for r in records} == {"gem_up"}
    assert {r.model_version for r in records} == {"m1-001"}
    finishes = [c.finish_reason for r in records for c in r.candidates or [] if c.finish_reason]
    assert finishes == [types.FinishReason.STOP]
    usage = records[-1].usage_metadata
    assert usage is not None
    assert (usage.prompt_token_count, usage.candidates_token_count) == (7, 3)
    first, second = sorted(ups, key=lambda u: u.posts[-1]["path"])
    assert [p["path"] for p in first.posts] == ["/v1/chat/completions"]
    asked = first.posts[0]["body"]
    assert asked["messages"] == [
        {"role": "system", "content": "Brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert asked["continue_final_message"] is True and asked["max_tokens"] == 48
    assert second.posts[0]["path"] == "/v1beta/models/m1:streamGenerateContent?alt=sse"
    assert (slot["tokens_in"], slot["tokens_out"], slot["errors"]) == (7, 3, 0)


def test_a_native_responses_stream_that_names_a_stored_response_is_not_continued() -> None:
    """The upstream holds a previous_response_id's history, not sluice: nothing to ask
    another replica with, so the error event ends the stream, as before."""
    with (
        upstreams("responses_resumable", "responses_resumable") as ups,
        gateway([u.url for u in ups], native_apis=["responses"], health_interval=60) as base,
    ):
        body = {"model": "m1", "input": "hi", "stream": True, "previous_response_id": "resp_0"}
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=10)
    name, error = anthropic_events(r.content)[-1]
    assert name == "error" and "dropped the stream" in json.dumps(error), error
    assert [p["path"] for u in ups for p in u.posts] == ["/v1/responses"]
