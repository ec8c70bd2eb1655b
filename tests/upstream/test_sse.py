"""The incremental SSE decoder: WHATWG parsing, exact raw bytes under any chunking."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.core.errors import UpstreamMalformed
from sluice.upstream.sse import SSEDecoder, SSEMessage

BOM = b"\xef\xbb\xbf"


def feed_all(chunks: list[bytes], decoder: SSEDecoder | None = None) -> list[SSEMessage]:
    decoder = decoder or SSEDecoder()
    out: list[SSEMessage] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    return out


def reference(data: bytes) -> tuple[list[tuple[bytes, str | None, str]], bytes]:
    """A byte-at-a-time WHATWG parser, written independently of the decoder: the
    messages (raw, event, data) of ``data`` as one whole input, and the rest."""
    out: list[tuple[bytes, str | None, str]] = []
    i = len(BOM) if data.startswith(BOM) else 0
    event_start = 0
    lines: list[bytes] = []
    line = bytearray()
    while i < len(data):
        c = data[i]
        if c in (0x0A, 0x0D):
            i += 1
            if c == 0x0D and i < len(data) and data[i] == 0x0A:
                i += 1
            if line:
                lines.append(bytes(line))
                line.clear()
                continue
            event: str | None = None
            values: list[str] = []
            for raw_line in lines:
                text = raw_line.decode("utf-8", "replace")
                if text.startswith(":"):
                    continue
                if ":" in text:
                    name, value = text.split(":", 1)
                    value = value.removeprefix(" ")
                else:
                    name, value = text, ""
                if name == "data":
                    values.append(value)
                elif name == "event":
                    event = value or None
            out.append((data[event_start:i], event, "\n".join(values)))
            event_start = i
            lines = []
        else:
            line.append(c)
            i += 1
    return out, data[event_start:]


def merge_split_crlf(messages: list[SSEMessage]) -> list[tuple[bytes, str | None, str]]:
    """The decoder's messages with a CRLF split across two chunks put back together
    (the decoder gives the LF as a message of its own; the reference saw both)."""
    out: list[tuple[bytes, str | None, str]] = []
    for m in messages:
        if m.raw == b"\n" and out and out[-1][0].endswith(b"\r"):
            raw, event, data = out[-1]
            out[-1] = (raw + b"\n", event, data)
        else:
            out.append((m.raw, m.event, m.data))
    return out


def test_openai_stream() -> None:
    d = SSEDecoder()
    first = d.feed(b'data: {"a": 1}\n\ndata: {"b"')
    assert first == [SSEMessage(b'data: {"a": 1}\n\n', None, '{"a": 1}')]
    assert d.pending() == b'data: {"b"'
    rest = d.feed(b": 2}\n\ndata: [DONE]\n\n")
    assert [m.data for m in rest] == ['{"b": 2}', "[DONE]"]
    assert d.pending() == b""


def test_fields() -> None:
    msgs = feed_all(
        [
            b"event: error\ndata: line1\ndata:line2\ndata:  two spaces\nid: 7\nretry: 5\n\n",
            b": ping\n\n",
            b"data\n\n",
            b"event\ndata: x\n\n",
            b"data: a:b\n\n",
            b"\n",
        ]
    )
    assert [(m.event, m.data) for m in msgs] == [
        ("error", "line1\nline2\n two spaces"),
        (None, ""),
        (None, ""),
        (None, "x"),
        (None, "a:b"),
        (None, ""),
    ]
    assert msgs[1].raw == b": ping\n\n"
    assert msgs[-1].raw == b"\n"


def test_line_endings() -> None:
    msgs = feed_all([b"data: a\r\ndata: b\r\n\r\ndata: c\rdata: d\r\rdata: e\n\r\n"])
    assert [m.data for m in msgs] == ["a\nb", "c\nd", "e"]
    assert [m.raw for m in msgs] == [
        b"data: a\r\ndata: b\r\n\r\n",
        b"data: c\rdata: d\r\r",
        b"data: e\n\r\n",
    ]


def test_crlf_split_across_chunks() -> None:
    d = SSEDecoder()
    # A CR at the end of a line inside an event: the LF of the next chunk completes it,
    # it is not a blank line.
    assert d.feed(b"data: a\r") == []
    assert d.feed(b"\ndata: b\r\n") == []
    # The blank line's CR ends the event at once (no waiting for the next chunk) ...
    (msg,) = d.feed(b"\r")
    assert (msg.raw, msg.data) == (b"data: a\r\ndata: b\r\n\r", "a\nb")
    # ... and the LF after it is given back as bytes with no fields.
    assert d.feed(b"\ndata: c\r\n\r\n") == [
        SSEMessage(b"\n", None, ""),
        SSEMessage(b"data: c\r\n\r\n", None, "c"),
    ]
    assert d.pending() == b""


def test_bom() -> None:
    d = SSEDecoder()
    assert d.feed(BOM[:1]) == []
    assert d.feed(BOM[1:2]) == []
    (msg,) = d.feed(BOM[2:] + b"data: x\n\n")
    assert msg == SSEMessage(BOM + b"data: x\n\n", None, "x")
    # Only at the start of the stream.
    (msg,) = d.feed(BOM + b"data: y\n\n")
    assert msg.data == "" and msg.raw == BOM + b"data: y\n\n"  # field "\ufeffdata"


def test_invalid_utf8_replaced_raw_kept() -> None:
    (msg,) = SSEDecoder().feed(b"data: \xff\xe2\x82\n\n")
    assert msg.data == "\ufffd\ufffd"
    assert msg.raw == b"data: \xff\xe2\x82\n\n"
    # A character split across chunks is whole in its event.
    d = SSEDecoder()
    assert d.feed(b"data: \xe2\x82") == []
    assert d.feed(b"\xac\n\n")[0].data == "\u20ac"


def test_max_pending() -> None:
    d = SSEDecoder(max_pending=100)
    d.feed(b"data: " + b"x" * 90)
    with pytest.raises(UpstreamMalformed):
        d.feed(b"x" * 20)
    # Completed events do not count, only what is held back.
    d = SSEDecoder(max_pending=100)
    assert len(d.feed((b"data: " + b"x" * 80 + b"\n\n") * 10)) == 10


_TOKENS = [
    b"data",
    b"data:",
    b"data: ",
    b"event:",
    b"event: e",
    b": c",
    b":",
    b" ",
    b"x",
    b"\xc3\xa9",
    b"\xff",
    b"\xe2",
    b"\n",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b"\r\n\r\n",
]


@st.composite
def stream_and_cuts(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    data = b"".join(draw(st.lists(st.sampled_from(_TOKENS), max_size=60)))
    if draw(st.booleans()):
        data = BOM + data
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=20)))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return data, chunks


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream_and_cuts())
def test_any_chunking_matches_reference(case: tuple[bytes, list[bytes]]) -> None:
    data, chunks = case
    d = SSEDecoder()
    msgs = feed_all(chunks, d)
    # Exactly the input: every byte in one message or in what is pending.
    assert b"".join(m.raw for m in msgs) + d.pending() == data
    expected, rest = reference(data)
    got = merge_split_crlf(msgs)
    assert got == expected
    assert d.pending() == rest


@pytest.mark.perf  # under 20 microseconds per event
def test_fast_enough() -> None:
    # Token-sized events arriving one per chunk: the per-token cost of the gateway.
    event = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"delta":{"content":"hi"}}]}\n\n'
    d = SSEDecoder()
    start = time.perf_counter()
    for _ in range(20_000):
        (msg,) = d.feed(event)
    per_event = (time.perf_counter() - start) / 20_000
    assert msg.data.startswith("{")
    assert per_event < 20e-6, per_event
