"""The SSE encoder: exact bytes of frames, pings and error frames."""

from __future__ import annotations

import json

from sluice.core.errors import EngineFailure
from sluice.core.frames import DONE, Frame
from sluice.server.sse import PING, encode, error_frame


def test_encode_exact_bytes() -> None:
    assert encode(DONE) == b"data: [DONE]\n\n"
    assert encode(Frame({"a": "é"})) == 'data: {"a":"é"}\n\n'.encode()
    assert encode(Frame({"x": 1}, event="error")) == b'event: error\ndata: {"x":1}\n\n'
    assert PING == b": ping\n\n"


def test_error_frame_carries_both_shapes() -> None:
    raw = error_frame(EngineFailure("boom"))
    assert raw.startswith(b"event: error\ndata: ") and raw.endswith(b"\n\n")
    payload = json.loads(raw.split(b"data: ", 1)[1])
    assert payload["message"] == "boom" and payload["type"] == "server_error"
    assert payload["error"]["message"] == "boom" and payload["error"]["type"] == "server_error"
    # A non-sluice exception becomes an engine failure, not a crash of the encoder.
    payload = json.loads(error_frame(RuntimeError("x")).split(b"data: ", 1)[1])
    assert payload["type"] == "server_error" and "RuntimeError" in payload["message"]
