"""Images in requests, checked and decoded before a model's projector sees them.

Every dialect turns its image parts into OpenAI ``image_url`` parts; for a local model
each one is read here: a ``data:`` URI's bytes (a URL's are fetched first, under the
download rules), checked by their own first bytes (never by the type the client
claims), their header's size checked against :data:`MAX_PIXELS` before any pixel is
decoded, then decoded whole to RGB by Pillow. llama.cpp's own decoder is never handed
bytes it cannot read: on bytes that are no image it tries to launch ``ffprobe``.

Example::

    picture = decode_image(data_uri_bytes("data:image/png;base64,iVBOR..."), "messages[0]")
    picture.width, picture.height, len(picture.rgb)  # 64, 64, 12288
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

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
    """The bytes of a ``data:[<type>][;base64],<data>`` URI (base64 only: an image)."""
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:"):
        raise InvalidRequest(f"{where}: not a data: URI", param=where)
    if not head.endswith(";base64"):
        raise InvalidRequest(
            f"{where}: an image's data: URI must be base64 (data:image/png;base64,...)",
            param=where,
        )
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequest(
            f"{where}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", param=where
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
