"""Backpressure: a streaming client that stops reading pauses its generation (bounded
memory, the others served normally), gets everything once it reads again, and is
aborted when it does not read for ``stall_timeout``. Through real HTTP and sockets."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest

from sluice.engine.scheduler import Planned, SlotView, plan_batch
from sluice.engine.types import SlotState
from tests.support.fakes import EOS, FakeSampler, ScriptedRunner
from tests.support.helpers import (
    CHAT,
    TEXT,
    chat_text,
    chunks,
    finishes,
    health,
    parse_sse,
    post_stream,
    prompt_for,
    served,
    text_text,
    user,
    wait_idle,
    wait_until,
)
from tests.support.servers import slow_socket

GEN = SlotState.GENERATING
PRE = SlotState.PREFILLING


# -- the planner ------------------------------------------------------------------------


def test_plan_leaves_paused_slots_out() -> None:
    slots = [
        SlotView(0, GEN, paused=True),
        SlotView(1, GEN),
        SlotView(2, PRE, prompt_remaining=50, paused=True),
        SlotView(3, PRE, prompt_remaining=900, admitted_at=1),
    ]
    plan = plan_batch(slots, 512, prefill_budget=128)
    assert plan == [Planned(1, 1, False), Planned(3, 128, True)]


def test_plan_prefill_is_not_capped_when_every_generating_slot_is_paused() -> None:
    slots = [SlotView(0, GEN, paused=True), SlotView(1, PRE, prompt_remaining=900)]
    assert plan_batch(slots, 512, prefill_budget=128) == [Planned(1, 512, True)]


def test_plan_is_empty_when_everything_is_paused() -> None:
    slots = [SlotView(0, GEN, paused=True), SlotView(1, PRE, prompt_remaining=9, paused=True)]
    assert plan_batch(slots, 512, prefill_budget=128) == []


# -- helpers ------------------------------------------------------------------------------


def sampler_for(runner: ScriptedRunner, prompt: str) -> FakeSampler:
    tokens = [ord(c) for c in prompt]
    return wait_until(
        lambda: next((s for s in reversed(runner.samplers) if s.prompt == tokens), None)
    )


def read_to_eof(sock: socket.socket, timeout: float = 20) -> tuple[bytes, bool]:
    """Everything until the server ends the connection; (bytes, ended by a reset)."""
    sock.settimeout(timeout)
    buf = bytearray()
    while True:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(buf), True
        if not data:
            return bytes(buf), False
        buf += data


def server_side_open(ports: tuple[int, int]) -> bool:
    """Whether the server still holds its end of the connection from client port
    ``ports[0]`` to server port ``ports[1]`` (/proc/net/tcp)."""
    client_port, server_port = ports
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(
        int(r[1].split(":")[1], 16) == server_port and int(r[2].split(":")[1], 16) == client_port
        for r in rows
    )


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """An HTTP/1.1 chunked response -> (body, whether the final empty chunk came)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:80]
    assert b"transfer-encoding: chunked" in head.lower()
    body = bytearray()
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            return bytes(body), True
        if len(rest) < size + 2:
            body += rest[:size]
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    return bytes(body), False


def stable(read: Any, quiet: float = 0.3, timeout: float = 15.0) -> Any:
    """Poll ``read()`` until its value has not changed for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"still changing after {timeout}s: {value!r}"
        time.sleep(0.01)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def big_pieces(tag: str, n: int, size: int = 2000) -> list[bytes]:
    """n distinct ~size-byte pieces: a lost, repeated or reordered one shows."""
    return [f"<{tag}{k:05d}>".encode() + b"x" * size for k in range(n)]


# -- a client that stops reading -------------------------------------------------------------


def test_slow_reader_is_paused_others_are_served_then_it_gets_everything() -> None:
    n = 400  # 800 kB of output: far more than the buffers on the way hold (~120 kB)
    pieces = big_pieces("s", n)
    runner = ScriptedRunner(step_delay=0.001, n_ctx_seq=4096)
    runner.scripts[prompt_for("slow")] = [*pieces, EOS]
    runner.scripts[prompt_for("other")] = [f"o{k} ".encode() for k in range(50)] + [EOS]
    with served(runner, parallel=2, stream_buffer=8) as (base, engine):
        sock = slow_socket(base, CHAT, {"messages": user("slow"), "stream": True})
        slow = sampler_for(runner, prompt_for("slow"))
        # The engine stops decoding it once its client is stream_buffer steps behind.
        paused_at = stable(lambda: slow.pos)
        assert 0 < paused_at < n // 2, paused_at
        assert engine.stats.paused == 1 and engine.stats.active == 1
        assert health(base)["slots"]["paused"] == 1
        # Nothing spins while it waits: this process (the server included) stays idle.
        cpu = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - cpu < 0.25
        # Another request on the same server is served normally meanwhile.
        decodes = len(runner.decodes)
        res = post_stream(base, CHAT, {"messages": user("other"), "stream": True})
        assert chat_text(res.chunks) == "".join(f"o{k} " for k in range(50))
        assert finishes(res.chunks) == {0: ["stop"]}
        assert len(runner.decodes) >= decodes + 50
        assert slow.pos == paused_at  # still paused: not one more token for it
        assert engine.stats.paused == 1
        # The client reads again: generation resumes and the stream is complete and right.
        raw, reset = read_to_eof(sock)
        sock.close()
        assert not reset
        body, ended = dechunk(raw)
        assert ended
        got = chunks(parse_sse(body))
        assert chat_text(got) == b"".join(pieces).decode()
        assert finishes(got) == {0: ["stop"]}
        assert slow.pos == n + 1
        wait_idle(base)
        assert engine.stats.paused == 0


def test_client_that_never_reads_is_aborted_after_stall_timeout() -> None:
    n = 400
    runner = ScriptedRunner(step_delay=0.001, n_ctx_seq=4096)
    runner.scripts["stuck"] = [*big_pieces("t", n), EOS]
    with served(runner, parallel=1, stream_buffer=8, stall_timeout=1.0) as (base, engine):
        t0 = time.monotonic()
        sock = slow_socket(base, TEXT, {"prompt": "stuck", "max_tokens": n, "stream": True})
        ports = (sock.getsockname()[1], sock.getpeername()[1])
        stuck = sampler_for(runner, "stuck")
        wait_until(lambda: engine.stats.paused == 1, timeout=10)
        paused_at = stuck.pos
        assert server_side_open(ports)
        wait_until(lambda: stuck.freed, timeout=10)
        took = time.monotonic() - t0
        assert took >= 1.0  # not before the client had stalled for stall_timeout
        assert stuck.pos == paused_at  # nothing more was decoded before the abort
        wait_idle(base)  # the slot is free
        assert engine.stats.paused == 0
        # The connection ends at once, though the client still reads nothing (a plain
        # close would wait for the client to take the unsent bytes first): a reset.
        wait_until(lambda: not server_side_open(ports), timeout=3)
        raw, reset = read_to_eof(sock, timeout=10)
        sock.close()
        assert reset or not dechunk(raw)[1]
        assert b"[DONE]" not in raw
        # The server carries on: the slot serves the next request.
        r = httpx.post(base + TEXT, json={"prompt": "next"}, timeout=10)
        assert r.json()["choices"][0]["text"] == "Hello world!"


def test_reader_slower_than_the_engine_gets_every_choice_complete() -> None:
    """Pauses and wake-ups many times over (a one-step buffer, n=2 sharing one sink)."""
    runner = ScriptedRunner(step_delay=0.0005, n_ctx_seq=4096)
    pieces = big_pieces("r", 300, size=500)
    runner.scripts["read slowly"] = [*pieces, EOS]
    with served(runner, parallel=2, stream_buffer=1) as (base, engine):
        body = {"prompt": "read slowly", "n": 2, "max_tokens": 1000, "stream": True}
        seen_paused: list[int] = []

        def watch() -> None:
            while not done.is_set():
                seen_paused.append(engine.stats.paused)
                time.sleep(0.002)

        done = threading.Event()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        sock = slow_socket(base, TEXT, body)
        raw = bytearray()
        while data := sock.recv(2048):  # ~1 MB/s at most: slower than the engine
            raw += data
            time.sleep(0.002)
        sock.close()
        done.set()
        watcher.join(5)
        body_bytes, ended = dechunk(bytes(raw))
        assert ended
        got = chunks(parse_sse(body_bytes))
        expected = b"".join(pieces).decode()
        assert text_text(got, 0) == expected and text_text(got, 1) == expected
        assert finishes(got) == {0: ["stop"], 1: ["stop"]}
        assert max(seen_paused) >= 1  # it did pause (and resume) on the way
        wait_idle(base)


@pytest.mark.parametrize("stream", [False, True])
def test_consumers_that_keep_up_are_never_paused(stream: bool) -> None:
    # 1 ms steps: still far faster than a real model's.
    runner = ScriptedRunner(step_delay=0.001, n_ctx_seq=4096)
    runner.scripts["fast"] = [f"{k} ".encode() for k in range(500)] + [EOS]
    with served(runner, parallel=1, stream_buffer=32) as (base, engine):
        seen: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(engine.stats.paused)
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        body = {"prompt": "fast", "max_tokens": 600, "stream": stream}
        if stream:
            text = text_text(post_stream(base, TEXT, body).chunks)
        else:
            text = httpx.post(base + TEXT, json=body, timeout=20).json()["choices"][0]["text"]
        done.set()
        watcher.join(5)
        assert text == "".join(f"{k} " for k in range(500))
        assert seen and max(seen) == 0


def test_a_fold_the_engine_outruns_is_paused_and_resumed_losslessly() -> None:
    """No step delay: the engine thread outruns the event loop itself, so even a
    non-streaming fold can fall a (one-step) buffer behind; the answer is intact."""
    runner = ScriptedRunner(n_ctx_seq=4096)
    runner.scripts["outrun"] = [f"{k} ".encode() for k in range(1000)] + [EOS]
    with served(runner, parallel=2, stream_buffer=1) as (base, _engine):
        body = {"prompt": "outrun", "n": 2, "max_tokens": 2000}
        r = httpx.post(base + TEXT, json=body, timeout=30)
        expected = "".join(f"{k} " for k in range(1000))
        assert [c["text"] for c in r.json()["choices"]] == [expected, expected]
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["stop", "stop"]
        wait_idle(base)
