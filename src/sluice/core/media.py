"""Images and audio in requests, checked and decoded before a model's projector sees them.

Every dialect turns its image parts into OpenAI ``image_url`` parts; for a local model
each one is read here: a ``data:`` URI's bytes (a URL's are fetched first, under the
download rules), checked by their own first bytes (never by the type the client
claims), their header's size checked against :data:`MAX_PIXELS` before any pixel is
decoded, then decoded whole to RGB by Pillow. llama.cpp's own decoder is never handed
bytes it cannot read: on bytes that are no image it tries to launch ``ffprobe``.

Audio (OpenAI's ``input_audio`` parts, ``/v1/audio/transcriptions``) is WAV, read here
by its header (length checked before any sample is decoded) to mono float32 samples,
resampled to the projector's rate by :func:`resample`. MP3, FLAC and other formats are
a 400 naming the formats taken: decoding them needs a decoder sluice does not carry
(llama.cpp's miniaudio decodes a whole file before its length can be checked).

Example::

    picture = decode_image(data_uri_bytes("data:image/png;base64,iVBOR..."), "messages[0]")
    picture.width, picture.height, len(picture.rgb)  # 64, 64, 12288
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np

from sluice.core.errors import InvalidRequest

MAX_PIXELS = 50_000_000  # an image's width x height (a 8K photo is 33 million)
MAX_IMAGES = 16  # images in one request
MAX_IMAGE_BYTES = 20 * 2**20  # one image's encoded bytes (OpenAI's own limit)

# The formats Pillow reads here, by their first bytes.
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
FORMATS = "PNG, JPEG, GIF, WebP or BMP"
_URL_SAFE = str.maketrans("-_", "+/")


@dataclass(frozen=True, slots=True)
class Picture:
    """An image decoded to 8-bit RGB, row by row; ``digest`` names its content."""

    rgb: bytes
    width: int
    height: int
    digest: bytes  # SHA-256 of the pixels and the size: the same image, the same digest


def sniff(data: bytes) -> str | None:
    """The image format ``data`` starts like (Pillow's name), or None."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def data_uri_bytes(url: str, where: str) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URI (base64 only: an image or a clip)."""
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:"):
        raise InvalidRequest(f"{where}: not a data: URI", param=where)
    if not head.endswith(";base64"):
        raise InvalidRequest(
            f"{where}: a data: URI must be base64 (data:image/png;base64,...)",
            param=where,
        )
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequest(
            f"{where}: the data is over {MAX_IMAGE_BYTES // 2**20} MiB", param=where
        )
    # URL-safe letters and missing padding too (protobuf's JSON writes bytes either way:
    # google-genai sends them URL-safe).
    text = payload.strip().translate(_URL_SAFE)
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the data: URI's base64 is malformed", param=where) from None


def base64_data_uri(b64: str, where: str) -> str:
    """A bare base64 image (Ollama's ``images``) as a ``data:`` URI of its own type."""
    head = b64.strip()[:64].translate(_URL_SAFE)
    try:
        start = base64.b64decode(head[: len(head) // 4 * 4], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: not base64 image data", param=where) from None
    return f"data:{image_mime(start)};base64,{b64.strip()}"


def image_mime(data: bytes) -> str:
    """The media type ``data`` starts like (``application/octet-stream``: no image)."""
    kind = sniff(data)
    return f"image/{kind.lower()}" if kind else "application/octet-stream"


def decode_image(data: bytes, where: str) -> Picture:
    """``data`` (an image file's bytes) checked and decoded; a 400 naming ``where`` for
    anything that is not a whole image of a known format within the limits."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequest(
            f"{where}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", param=where
        )
    kind = sniff(data)
    if kind is None:
        raise InvalidRequest(f"{where}: the data is not an image ({FORMATS})", param=where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=[kind]) as image:
                width, height = image.size
                if width <= 0 or height <= 0:
                    raise InvalidRequest(f"{where}: the image has no pixels", param=where)
                if width * height > MAX_PIXELS:
                    raise InvalidRequest(
                        f"{where}: the image is {width} x {height} pixels; at most "
                        f"{MAX_PIXELS:,} pixels are taken",
                        param=where,
                    )
                image.seek(0)  # an animation's first frame
                rgb = image.convert("RGB")
                pixels = rgb.tobytes()
    except InvalidRequest:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(
            f"{where}: the image's header claims more than {MAX_PIXELS:,} pixels", param=where
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated, corrupt
        raise InvalidRequest(
            f"{where}: the {kind} image could not be decoded ({exc})", param=where
        ) from None
    digest = hashlib.sha256(pixels)
    digest.update(f"{width}x{height}".encode())
    return Picture(pixels, width, height, digest.digest())


# -- audio ------------------------------------------------------------------------------

MAX_AUDIO_SECONDS = 300  # one clip's length (Whisper-style encoders take it 30 s at a time)
MAX_AUDIO_BYTES = MAX_IMAGE_BYTES  # one clip's (16 kHz 16-bit mono: 11 minutes)
AUDIO_FORMATS = "WAV (PCM 8, 16, 24 or 32 bit, or float)"
_WAV_SAMPLES = {(1, 8): "u1", (1, 16): "<i2", (1, 32): "<i4", (3, 32): "<f4", (3, 64): "<f8"}


@dataclass(frozen=True, slots=True)
class Sound:
    """A clip decoded to mono float32 samples in [-1, 1] at ``rate`` Hz; ``digest``
    names its content."""

    samples: bytes  # float32, native order
    rate: int
    digest: bytes

    @property
    def seconds(self) -> float:
        return len(self.samples) / 4 / self.rate


def sniff_audio(data: bytes) -> str | None:
    """The audio format ``data`` starts like (``WAV``, ``MP3``, ``FLAC``, ``OGG``), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    return None


def decode_audio(data: bytes, where: str) -> Sound:
    """``data`` (an audio file's bytes) checked and decoded; a 400 naming ``where`` for
    anything that is not a whole WAV file within the limits. Its length is read from
    the header before any sample is decoded."""
    if len(data) > MAX_AUDIO_BYTES:
        raise InvalidRequest(
            f"{where}: the audio is over {MAX_AUDIO_BYTES // 2**20} MiB", param=where
        )
    kind = sniff_audio(data)
    if kind != "WAV":
        what = f"{kind} audio" if kind else "the data is no audio file"
        raise InvalidRequest(f"{where}: {what}; audio is taken as {AUDIO_FORMATS}", param=where)
    fmt, pcm = _wav_chunks(data, where)
    tag, channels, rate, _rate_bytes, align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == 0xFFFE and len(fmt) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the subformat's tag
        tag = int.from_bytes(fmt[24:26], "little")
    if (tag, bits) not in _WAV_SAMPLES and (tag, bits) != (1, 24):
        raise InvalidRequest(
            f"{where}: WAV of format {tag} with {bits}-bit samples; audio is taken as "
            f"{AUDIO_FORMATS}",
            param=where,
        )
    if not 1 <= channels <= 16 or not 1000 <= rate <= 384_000 or align != channels * bits // 8:
        raise InvalidRequest(f"{where}: the WAV header is inconsistent", param=where)
    frames = len(pcm) // align
    if frames == 0:
        raise InvalidRequest(f"{where}: the audio has no samples", param=where)
    if frames / rate > MAX_AUDIO_SECONDS:
        raise InvalidRequest(
            f"{where}: the audio is {frames / rate:.0f} s long; at most "
            f"{MAX_AUDIO_SECONDS} s are taken",
            param=where,
        )
    samples = _wav_samples(pcm[: frames * align], tag, bits).reshape(frames, channels)
    mono = samples.mean(axis=1, dtype=np.float32) if channels > 1 else samples[:, 0]
    out = np.ascontiguousarray(np.clip(mono, -1.0, 1.0), dtype=np.float32).tobytes()
    digest = hashlib.sha256(out)
    digest.update(f"audio@{rate}".encode())
    return Sound(out, rate, digest.digest())


def _wav_chunks(data: bytes, where: str) -> tuple[bytes, bytes]:
    """A WAV file's ``fmt `` and ``data`` chunks (a data chunk cut short, as a stream
    writer leaves it, is taken as far as it goes)."""
    fmt: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = data[pos + 8 : pos + 8 + size]
        if kind == b"fmt ":
            fmt = body
        elif kind == b"data":
            if fmt is None or len(fmt) < 16:
                break
            return fmt, body
        pos += 8 + size + (size & 1)
    raise InvalidRequest(
        f"{where}: not a whole WAV file (no 'fmt ' chunk before its 'data')", param=where
    )


def _wav_samples(pcm: bytes, tag: int, bits: int) -> np.ndarray:
    """PCM bytes as float32 in [-1, 1]."""
    if (tag, bits) == (1, 24):
        raw = np.frombuffer(pcm, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        wide = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        return (np.where(wide >= 1 << 23, wide - (1 << 24), wide) / float(1 << 23)).astype(
            np.float32
        )
    values = np.frombuffer(pcm, dtype=_WAV_SAMPLES[(tag, bits)])
    if tag == 3:
        return np.nan_to_num(values.astype(np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    if bits == 8:
        return ((values.astype(np.float32) - 128.0) / 128.0).astype(np.float32)
    return (values / float(1 << (bits - 1))).astype(np.float32)


def resample(sound: Sound, rate: int) -> np.ndarray:
    """``sound``'s samples at ``rate`` Hz (float32): a windowed-sinc low-pass below the
    lower rate's Nyquist frequency, then linear interpolation."""
    samples = np.frombuffer(sound.samples, dtype=np.float32)
    if rate == sound.rate:
        return samples
    if rate < sound.rate:  # band-limit first: what the lower rate cannot hold would alias
        cutoff = 0.5 * rate / sound.rate  # cycles per source sample
        taps = np.arange(-32, 33, dtype=np.float64)
        kernel = 2 * cutoff * np.sinc(2 * cutoff * taps) * np.hanning(len(taps))
        kernel /= kernel.sum()
        samples = np.convolve(samples, kernel.astype(np.float32), mode="same")
    n = max(1, round(len(samples) * rate / sound.rate))
    at = np.arange(n, dtype=np.float64) * (sound.rate / rate)
    return np.interp(at, np.arange(len(samples)), samples).astype(np.float32)


def media_kind(data: bytes) -> str:
    """``"audio"`` for bytes that start like an audio file, else ``"image"`` (whose
    decoding then says what is wrong with them)."""
    return "audio" if sniff_audio(data) is not None and sniff(data) is None else "image"
