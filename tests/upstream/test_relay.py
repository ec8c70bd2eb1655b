"""The relay (upstream/backend.py ``Relay``): whatever chunks the upstream's socket
gives, only whole events are written, byte for byte; the metrics are fed; a malformed
event ends it after the events ahead of it; an early end is an error."""

from __future__ import annotations

import json

import pytest

from sluice.core.errors import UpstreamFailed, UpstreamMalformed
from sluice.metrics import Metrics, OpenAIChunkTap
from sluice.upstream.backend import Passthrough, Relay


def event(content: str, finish: str | None = None) -> bytes:
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": content}}]}
    chunk["choices"][0]["finish_reason"] = finish  # type: ignore[index]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


USAGE = b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


async def relayed(*chunks: bytes) -> tuple[list[bytes], object, Passthrough]:
    metrics = Metrics()
    answer = Passthrough(OpenAIChunkTap(metrics.slot("s", "upstream").request()), "s", "m")
    written: list[bytes] = []
    relay = Relay(answer, written.append)
    for chunk in chunks:
        relay.feed(chunk)
    relay.end(None)
    return written, relay.done.result(), answer


async def test_whole_chunks_go_out_as_they_came_and_are_metered() -> None:
    stream = [event("Hel") + event("lo"), event("!", "stop") + USAGE, DONE]
    written, error, answer = await relayed(*stream)
    assert written == stream and error is None
    meter = answer.meter
    assert meter.finished and meter.counted == 3


async def test_events_cut_anywhere_are_written_only_whole() -> None:
    body = event("Hel") + event("lo", "stop") + USAGE + DONE
    cuts = [b"", body[:5], body[5:40], body[40:41], body[41:]]
    written, error, _ = await relayed(*cuts)
    assert b"".join(written) == body and error is None
    assert all(w.endswith(b"\n\n") for w in written)


async def test_crlf_and_comments_pass_byte_for_byte() -> None:
    body = b": keep-alive\r\n\r\n" + event("a").replace(b"\n", b"\r\n") + event("b", "stop") + DONE
    written, error, _ = await relayed(body[:10], body[10:])
    assert b"".join(written) == body and error is None


@pytest.mark.parametrize("split", [False, True])
async def test_a_malformed_event_ends_it_after_those_ahead(split: bool) -> None:
    good, bad = event("ok"), b"data: {not json\n\n"
    chunks = [good, bad + event("never")] if split else [good + bad + event("never")]
    written, error, answer = await relayed(*chunks)
    assert b"".join(written) == good
    assert isinstance(error, UpstreamMalformed)
    assert answer.meter.finished


async def test_an_early_end_is_an_error() -> None:
    written, error, _ = await relayed(event("Hel"))
    assert written == [event("Hel")]
    assert isinstance(error, UpstreamFailed) and "before finishing" in error.message
