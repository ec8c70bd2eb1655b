"""Audio clips (sluice.core.media): WAV read by its header and decoded to mono float32,
resampled to a projector's rate; anything else a 400 that names what is taken."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from sluice.core.errors import InvalidRequest
from sluice.core.media import (
    MAX_AUDIO_SECONDS,
    decode_audio,
    media_kind,
    resample,
    sniff_audio,
)
from tests.support.audio import float_wav, tone, wav


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_pcm_wav_decodes_to_mono_float(width: int, channels: int) -> None:
    source = tone(440, 0.25, 8000)
    sound = decode_audio(wav(source, 8000, width=width, channels=channels), "file")
    got = np.frombuffer(sound.samples, dtype=np.float32)
    assert sound.rate == 8000 and len(got) == len(source)
    assert sound.seconds == pytest.approx(0.25)
    assert np.abs(got - source).max() < (0.02 if width == 1 else 1e-3)


def test_float_wav_and_the_digest_names_the_content() -> None:
    source = tone(440, 0.1, 16000)
    a = decode_audio(float_wav(source, 16000), "x")
    assert np.array_equal(np.frombuffer(a.samples, dtype=np.float32), source)
    assert decode_audio(float_wav(source, 16000), "x").digest == a.digest
    assert decode_audio(float_wav(source * 0.5, 16000), "x").digest != a.digest


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"ID3\x04\x00" + b"\x00" * 64, "MP3 audio; audio is taken as WAV"),
        (b"\xff\xfb\x90\x00" + b"\x00" * 64, "MP3 audio"),
        (b"fLaC" + b"\x00" * 64, "FLAC audio"),
        (b"OggS" + b"\x00" * 64, "OGG audio"),
        (b"hello, not a clip", "no audio file"),
        (b"RIFF\x10\x00\x00\x00WAVEjunk", "not a whole WAV file"),
    ],
)
def test_other_bytes_are_a_400_naming_what_is_taken(data: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_audio(data, "messages[0].content[1].input_audio")
    assert words in info.value.message
    assert info.value.param == "messages[0].content[1].input_audio"


def test_a_clip_over_the_limit_is_refused_by_its_header() -> None:
    rate = 1000  # one second over, in few bytes
    long = wav(np.zeros(rate * (MAX_AUDIO_SECONDS + 1), dtype=np.float32), rate, width=1)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_AUDIO_SECONDS} s"):
        decode_audio(long, "file")
    empty = wav(np.zeros(0, dtype=np.float32), 8000)
    with pytest.raises(InvalidRequest, match="no samples"):
        decode_audio(empty, "file")


def test_an_inconsistent_header_is_a_400() -> None:
    good = bytearray(wav(tone(440, 0.1, 8000), 8000))
    good[32:34] = struct.pack("<H", 3)  # block align that is not channels x bytes
    with pytest.raises(InvalidRequest, match="inconsistent"):
        decode_audio(bytes(good), "file")


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / len(samples))


def test_resampling_keeps_a_tone_and_drops_what_the_lower_rate_cannot_hold() -> None:
    kept = decode_audio(wav(tone(1000, 1.0, 48000), 48000), "f")
    down = resample(kept, 16000)
    assert len(down) == 16000 and down.dtype == np.float32
    assert dominant_hz(down, 16000) == pytest.approx(1000, abs=2)
    assert np.sqrt(np.mean(down**2)) == pytest.approx(0.5 / math.sqrt(2), rel=0.05)
    # 12 kHz would fold to 4 kHz at 16 kHz: the low-pass takes it out first.
    high = resample(decode_audio(wav(tone(12000, 1.0, 48000), 48000), "f"), 16000)
    assert np.sqrt(np.mean(high**2)) < 0.02
    up = resample(decode_audio(wav(tone(440, 0.5, 8000), 8000), "f"), 16000)
    assert len(up) == 8000 and dominant_hz(up, 16000) == pytest.approx(440, abs=3)
    same = resample(kept, 48000)
    assert np.array_equal(same, np.frombuffer(kept.samples, dtype=np.float32))


def test_sniffing_tells_audio_from_images() -> None:
    assert sniff_audio(wav(tone(440, 0.01, 8000), 8000)) == "WAV"
    assert media_kind(wav(tone(440, 0.01, 8000), 8000)) == "audio"
    assert media_kind(b"\xff\xd8\xff\xe0 a jpeg") == "image"
    assert media_kind(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image"
