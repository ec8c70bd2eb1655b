"""A streaming client that stops reading, on the real model: generation pauses and the
server's memory stays flat, then generation resumes when the client reads again."""

from __future__ import annotations

import time

import pytest

from tests.support.real_server import QUIET, data_chunks, health, parse_sse, wait_idle
from tests.support.servers import serve_process_handle, slow_socket

pytestmark = pytest.mark.integration

MAX_TOKENS = 400
# Every frame carries 20 alternatives per token (~2 kB), so the buffers between the
# server and a client that reads nothing fill within a hundred tokens or so.
BODY = {
    "messages": [{"role": "user", "content": "Tell me a very long story."}],
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def dechunk(raw: bytes) -> bytes:
    """A complete HTTP/1.1 chunked 200 response -> its body."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:80]
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]


def generated(base: str) -> int:
    return int(health(base)["engine"]["tokens_generated"])


def test_slow_reader_pauses_generation_with_flat_memory() -> None:
    with serve_process_handle(
        "--parallel", "2", "--ctx", "1024", "--stream-buffer", "16", *QUIET
    ) as (base, proc):
        sock = slow_socket(base, "/v1/chat/completions", BODY, timeout=60)
        # Generation runs until the buffers on the way are full, then stops.
        deadline = time.monotonic() + 60
        last, since = generated(base), time.monotonic()
        while time.monotonic() - since < 1.5:
            assert time.monotonic() < deadline, f"generation never paused ({last} tokens)"
            time.sleep(0.05)
            now = generated(base)
            if now != last:
                last, since = now, time.monotonic()
        stalled_at = last
        assert 0 < stalled_at < MAX_TOKENS // 2, stalled_at
        slots = health(base)["slots"]
        assert slots["active"] == 1 and slots["paused"] == 1  # paused, not finished
        # While the client reads nothing: no tokens, and the server's memory stays flat.
        rss = [rss_kb(proc.pid)]
        for _ in range(20):
            time.sleep(0.1)
            rss.append(rss_kb(proc.pid))
            assert generated(base) == stalled_at
        assert max(rss) - rss[0] < 1024, rss  # under 1 MB of drift
        # The client reads again: generation resumes and runs to the end.
        raw = bytearray()
        while data := sock.recv(1 << 16):
            raw += data
        sock.close()
        chunks = data_chunks(parse_sse(dechunk(bytes(raw))))
        content = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        tokens = sum(len(c["choices"][0]["logprobs"]["content"]) for c in content)
        assert tokens == MAX_TOKENS
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert generated(base) == MAX_TOKENS
        wait_idle(base)
