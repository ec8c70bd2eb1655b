"""Images given by URL, fetched for a local model under the download rules.

An OpenAI ``image_url`` (or an Anthropic ``url`` image source, which becomes one) may be
an http(s) URL. For a local model sluice fetches it itself before the request is
prepared, and hands the model a ``data:`` URI of what it got: with the same rules as
model downloads (``--download-allowed-hosts``; loopback, private, link-local and other
non-public addresses refused unless ``--download-allow-private``, checked at every
connection, redirects included), at most :data:`~sluice.core.media.MAX_IMAGE_BYTES`,
within :data:`FETCH_SECONDS`. Any failure is a 400 naming the part. An upstream model
gets the URL as it came: the upstream fetches it.

Example::

    request = await ImageFetcher(settings).resolve(request)  # http(s) URLs -> data: URIs
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace
from typing import Any

import httpx

from sluice.config import Settings
from sluice.core import addresses
from sluice.core.errors import InvalidRequest
from sluice.core.media import MAX_IMAGE_BYTES, image_mime
from sluice.core.request import GenerationRequest
from sluice.models.download_checks import on_allowed_hosts, public_only_transport

FETCH_SECONDS = 30.0  # one image, connection to last byte
MAX_REDIRECTS = 5


def _remote(url: Any) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def _parts(request: GenerationRequest) -> list[tuple[int, int, dict[str, Any]]]:
    """(message, part, the part's image_url) of every image given by http(s) URL."""
    found = []
    for i, message in enumerate(request.messages or ()):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            image = part.get("image_url") if isinstance(part, dict) else None
            if isinstance(image, dict) and _remote(image.get("url")):
                found.append((i, j, image))
    return found


class ImageFetcher:
    """Fetches a request's image URLs (one client per request: nothing is shared)."""

    def __init__(self, settings: Settings) -> None:
        self._allow_private = settings.download_allow_private
        self._allowed_hosts = settings.download_allowed_hosts

    async def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with each image URL replaced by a ``data:`` URI of its bytes."""
        found = _parts(request)
        if not found:
            return request
        transport = None if self._allow_private else public_only_transport()
        async with httpx.AsyncClient(
            transport=transport, follow_redirects=False, timeout=FETCH_SECONDS
        ) as client:
            fetched = await asyncio.gather(
                *(
                    self._fetch(client, image["url"], f"messages[{i}].content[{j}]")
                    for i, j, image in found
                )
            )
        messages = [dict(m) for m in request.messages or ()]
        for (i, j, _), uri in zip(found, fetched):
            content = list(messages[i]["content"])
            content[j] = {"type": "image_url", "image_url": {"url": uri}}
            messages[i]["content"] = content
        return replace(request, messages=messages)

    async def _fetch(self, client: httpx.AsyncClient, url: str, where: str) -> str:
        try:
            async with asyncio.timeout(FETCH_SECONDS):
                for _ in range(MAX_REDIRECTS + 1):
                    self._check_host(url, where)
                    async with client.stream("GET", url) as response:
                        if response.is_redirect and "location" in response.headers:
                            url = str(response.url.join(response.headers["location"]))
                            continue
                        if response.status_code != 200:
                            raise InvalidRequest(
                                f"{where}: fetching the image answered {response.status_code}",
                                param=where,
                            )
                        data = await _read_capped(response, where)
                        break
                else:
                    raise InvalidRequest(
                        f"{where}: the image URL redirected more than {MAX_REDIRECTS} times",
                        param=where,
                    )
        except TimeoutError:
            raise InvalidRequest(
                f"{where}: the image was not fetched within {FETCH_SECONDS:g} s", param=where
            ) from None
        except addresses.NotPublic as exc:
            raise InvalidRequest(
                f"{where}: the image's host {exc}; this server does not fetch from such "
                "addresses (--download-allow-private)",
                param=where,
            ) from None
        except httpx.HTTPError as exc:
            raise InvalidRequest(
                f"{where}: the image could not be fetched ({exc})", param=where
            ) from None
        return f"data:{image_mime(data)};base64,{base64.b64encode(data).decode('ascii')}"

    def _check_host(self, url: str, where: str) -> None:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https"):
            raise InvalidRequest(f"{where}: an image URL must be http(s)", param=where)
        if not on_allowed_hosts(parsed, self._allowed_hosts):
            raise InvalidRequest(
                f"{where}: the image host {parsed.host!r} is not on this server's allowed "
                "hosts (--download-allowed-hosts)",
                param=where,
            )


async def _read_capped(response: httpx.Response, where: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
        raise InvalidRequest(
            f"{where}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", param=where
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_IMAGE_BYTES:
            raise InvalidRequest(
                f"{where}: the image is over {MAX_IMAGE_BYTES // 2**20} MiB", param=where
            )
        parts.append(chunk)
    return b"".join(parts)
