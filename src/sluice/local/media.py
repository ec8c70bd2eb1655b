"""Images and audio in a chat for a local model: out of the messages, into the prompt's tokens.

Every dialect hands a local model OpenAI-shaped messages whose content may be a list of
parts, ``text``, ``image_url`` and (OpenAI chat) ``input_audio``. Before the template
renders them:

1. :func:`take_images` writes each image part as :data:`IMAGE_MARK` in its message's
   text (after the control-text guard escaped the request's own text, so no input can
   write the mark) and returns the images' sources in order;
2. :func:`pictures` reads each source (a ``data:`` URI; an http(s) URL was fetched into
   one before, ``LocalModel.open``; a clip's base64 is made one) and decodes it as its
   own bytes say, an image or a WAV clip (``core.media``);
3. :func:`tokens_with_images` tokenizes the rendered prompt piece by piece between the
   marks, and puts each image's projector pieces where its mark was: the text the
   projector wraps it in, and its rows as placeholders (negative ids drawn from the
   image's digest: the prompt cache knows an image by its content) with their
   :class:`~sluice.engine.types.MediaSpan`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.core.errors import InvalidRequest
from sluice.core.media import (
    MAX_IMAGES,
    Picture,
    Sound,
    data_uri_bytes,
    decode_audio,
    decode_image,
    media_kind,
)
from sluice.engine.types import MediaSpan

IMAGE_MARK = "\ue000\ue0ff"  # U+E000 typed by a client is escaped by the guard first

ImageSource = tuple[str, str]  # (url, where in the request)


def has_images(messages: list[dict[str, Any]] | None) -> bool:
    """Whether any message holds an image part."""
    return _has_part(messages, "image_url")


def has_audio(messages: list[dict[str, Any]] | None) -> bool:
    """Whether any message holds an audio part (``input_audio``)."""
    return _has_part(messages, "input_audio")


def _has_part(messages: list[dict[str, Any]] | None, kind: str) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == kind for p in m["content"])
        for m in messages or ()
    )


def take_images(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """The messages with their content as text, each image part written as
    :data:`IMAGE_MARK`; the images' URLs in prompt order."""
    out: list[dict[str, Any]] = []
    sources: list[ImageSource] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        text: list[str] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(str(part.get("text") or ""))
            elif kind == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str) or not url:
                    raise InvalidRequest(f"{where}.image_url.url is missing", param=where)
                sources.append((url, f"{where}.image_url"))
                text.append(IMAGE_MARK)
            elif kind == "input_audio":
                sources.append((_audio_uri(part.get("input_audio"), where), f"{where}.input_audio"))
                text.append(IMAGE_MARK)
            else:
                raise InvalidRequest(
                    f"{where}: parts of type '{kind}' are not supported", param=where
                )
        out.append({**message, "content": "".join(text)})
    if len(sources) > MAX_IMAGES:
        raise InvalidRequest(
            f"The request has {len(sources)} images; at most {MAX_IMAGES} are taken at once.",
            param="messages",
        )
    return out, sources


def _audio_uri(audio: object, where: str) -> str:
    """An ``input_audio`` part's ``{"data": <base64>, "format": ...}`` as a ``data:`` URI
    (its format is read from its bytes later, not from ``format``)."""
    data = audio.get("data") if isinstance(audio, dict) else None
    if not isinstance(data, str) or not data:
        raise InvalidRequest(f"{where}.input_audio.data is missing", param=where)
    return f"data:audio/wav;base64,{data}"


def pictures(sources: list[ImageSource]) -> list[Picture | Sound]:
    """Each source read and decoded, an image or a clip as its bytes say (a 400 naming
    the part for anything wrong)."""
    out: list[Picture | Sound] = []
    for url, where in sources:
        if not url.startswith("data:"):
            raise InvalidRequest(
                f"{where}: only data: URIs and http(s) URLs are taken", param=where
            )
        data = data_uri_bytes(url, where)
        if where.endswith(".input_audio") or media_kind(data) == "audio":
            out.append(decode_audio(data, where))
        else:
            out.append(decode_image(data, where))
    return out


def placeholders(picture: Picture | Sound, n: int) -> list[int]:
    """``n`` negative ids that only this image's rows have (``n`` < 4096)."""
    base = int.from_bytes(picture.digest[:6], "big") << 12
    return [-(base + k + 1) for k in range(n)]


def tokens_with_images(
    rendered: str,
    images: list[Picture | Sound],
    tokenize: Callable[[str, bool], list[int]],
    pieces: Callable[[Picture | Sound, str], list[Any]],
    *,
    bos: list[int],
    max_rows: int,
) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """The rendered prompt's tokens with each image in place of its mark.

    ``tokenize(text, first)`` tokenizes a piece of the template's text; ``pieces``
    is the projector's (token lists and image chunks); ``bos`` goes first when the
    prompt starts with an image. An image over ``max_rows`` rows is a 400 (its rows
    are decoded in one batch)."""
    texts = rendered.split(IMAGE_MARK)
    if len(texts) != len(images) + 1:
        raise InvalidRequest(
            f"The model's chat template placed {len(texts) - 1} of the {len(images)} images "
            "it was given; this model cannot take images where they were sent.",
            param="messages",
        )
    tokens: list[int] = []
    media: list[MediaSpan] = []
    for i, text in enumerate(texts):
        if text:
            tokens += tokenize(text, i == 0)
        elif i == 0:
            tokens += bos
        if i == len(images):
            break
        picture = images[i]
        where = f"image {i + 1}"
        for piece in pieces(picture, where):
            if isinstance(piece, list):
                tokens += piece
                continue
            if piece.n > max_rows:
                raise InvalidRequest(
                    f"{where} takes {piece.n} tokens; this model decodes at most {max_rows} "
                    "at once (--batch)",
                    param="messages",
                )
            media.append(MediaSpan(len(tokens), piece.n, piece, piece.non_causal))
            tokens += placeholders(picture, piece.n)
    if media and media[-1].end == len(tokens):
        raise InvalidRequest("The prompt cannot end with an image.", param="messages")
    return tokens, tuple(media)
