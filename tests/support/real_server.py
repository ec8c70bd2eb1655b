"""For tests against ``sluice serve`` on the real model: flags, raw SSE parsing, /health polling."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

# Flags every test server gets. One llama.cpp thread: on this shared 2-core machine, two
# threads spin-waiting on each other while other processes compete for the cores made
# decoding 3-10x slower. Log level warning: serve_process pipes the server's output
# without reading it, so per-request access logs could fill the pipe and stall it.
QUIET = ("--log-level", "warning", "--threads", "1")

CHAT_HELLO = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "stream": True}
TEXT_ONCE = {"prompt": "Once upon a time", "max_tokens": 32, "stream": True}


@dataclass
class SSEEvent:
    event: str | None
    data: str
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.data)


def split_frames(body: bytes) -> list[bytes]:
    """Split a raw SSE body into frames, asserting every frame ends with a blank line."""
    assert body.endswith(b"\n\n"), f"stream does not end with a blank line: {body[-80:]!r}"
    frames = body.split(b"\n\n")
    assert frames[-1] == b""
    return [f + b"\n\n" for f in frames[:-1]]


def parse_sse(body: bytes, *, allow_comments: bool = False) -> list[SSEEvent]:
    """Strictly parse an SSE body: every frame is `data: <payload>\\n\\n` (or with `event:`)."""
    events: list[SSEEvent] = []
    for frame in split_frames(body):
        lines = frame[:-2].split(b"\n")
        if all(line.startswith(b":") for line in lines):
            assert allow_comments, f"unexpected comment frame {frame!r}"
            continue
        name = None
        if lines[0].startswith(b"event: "):
            name = lines[0][len(b"event: ") :].decode()
            lines = lines[1:]
        assert len(lines) == 1, f"frame is not one data line: {frame!r}"
        assert lines[0].startswith(b"data: "), f"frame lacks 'data: ': {frame!r}"
        events.append(SSEEvent(name, lines[0][len(b"data: ") :].decode("utf-8"), frame))
    return events


def data_chunks(events: list[SSEEvent]) -> list[dict[str, Any]]:
    """The JSON chunks of an OpenAI stream, checking it ends with exactly one [DONE]."""
    assert all(e.event is None for e in events), [e.raw for e in events if e.event]
    assert events, "empty stream"
    assert events[-1].raw == b"data: [DONE]\n\n"
    assert sum(e.data == "[DONE]" for e in events) == 1
    return [e.json() for e in events[:-1]]


def health(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/health", timeout=5).json()  # type: ignore[no-any-return]


def wait_idle(base: str, within: float = 3.0) -> float:
    """Poll /health until no slot is active or queued; return the seconds it took."""
    start = time.monotonic()
    while True:
        slots = health(base)["slots"]
        if slots["active"] == 0 and slots["queued"] == 0:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"slots still busy after {within}s: {slots}")
        time.sleep(0.02)


def chat_text(chunks: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == index
    )


def outcome_counts(base: str, headers: dict[str, str], key: str = "default") -> dict[str, float]:
    """What /metrics says now, in one request (which the key's count includes):
    requests by the key, and generations (any model) by outcome."""
    text = httpx.get(f"{base}/metrics", headers=headers, timeout=10).text

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", text, re.MULTILINE))

    return {
        "keyed": total(rf'sluice_requests_by_key_total\{{key="{key}"\}}'),
        "ok": total(r'sluice_requests_total\{outcome="ok",[^}]*\}'),
        "error": total(r'sluice_requests_total\{outcome="error",[^}]*\}'),
    }
