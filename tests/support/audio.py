"""Audio clips for the tests: tones written as WAV files (the standard library's
``wave``, and IEEE float, which ``wave`` cannot write)."""

from __future__ import annotations

import io
import math
import struct
import wave

import numpy as np


def tone(hz: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * math.pi * hz * t)).astype(np.float32)


def wav(samples: np.ndarray, rate: int, *, width: int = 2, channels: int = 1) -> bytes:
    """A PCM WAV file written by the standard library's ``wave``."""
    frames = np.repeat(samples[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = (frames * 127 + 128).astype(np.uint8).tobytes()
    elif width == 2:
        raw = (frames * 32767).astype("<i2").tobytes()
    elif width == 3:
        ints = (frames * (2**23 - 1)).astype("<i4")
        raw = b"".join(int(v).to_bytes(4, "little", signed=True)[:3] for v in ints)
    else:
        raw = (frames * (2**31 - 1)).astype("<i4").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return out.getvalue()


def float_wav(samples: np.ndarray, rate: int) -> bytes:
    """A WAVE_FORMAT_IEEE_FLOAT file (which ``wave`` cannot write)."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body
