"""What a download is checked against before and while it runs: the URL, the file
name it gets in the models folder, the SHA-256 given, and the addresses it may
connect to (public ones only, unless private ones are allowed).

Example::

    check_url(url); name = file_name(url, None); digest = check_sha256(sha256)
    client = httpx.AsyncClient(transport=public_only_transport())
"""

from __future__ import annotations

import re
import ssl
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

from sluice.core import addresses
from sluice.core.errors import InvalidRequest

_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_NAME_MAX_BYTES = 255 - len(".part")  # most filesystems cap a name at 255 bytes


def public_only_transport(
    inner: httpcore.AsyncNetworkBackend | None = None, *, verify: ssl.SSLContext | bool = True
) -> httpx.AsyncHTTPTransport:
    """An httpx transport that connects to public addresses only.

    Its connection pool's network backend resolves each host itself and connects
    to the resolved address by number, after checking it: the address connected
    is the address checked (no DNS rebinding), for the first request and for
    every redirect, while TLS still verifies and sends the host name (httpcore
    takes SNI and the certificate name from the URL, not from the socket). A
    refused address raises :class:`~sluice.core.addresses.NotPublic` out of the
    request. ``inner`` makes the connections (default: httpcore's AnyIO backend);
    ``verify`` is httpx's.
    """
    transport = httpx.AsyncHTTPTransport(verify=verify)
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, httpcore.AsyncConnectionPool) or not hasattr(
        pool, "_network_backend"
    ):  # pragma: no cover (an httpx whose pool is not the one we know)
        raise RuntimeError(
            "cannot check download addresses at connect time with this httpx; "
            "start with --download-allow-private to download without the check"
        )
    pool._network_backend = _PublicOnlyBackend(
        inner or httpcore.AnyIOBackend(),
        connect_error=httpcore.ConnectError,  # a name that does not resolve: retried
        connect_timeout=httpcore.ConnectTimeout,
    )
    return transport


class _PublicOnlyBackend(addresses.PublicOnlyConnector, httpcore.AsyncNetworkBackend):
    """Resolves, checks, then connects to the checked addresses by number."""


def on_allowed_hosts(url: httpx.URL, allowed_hosts: str | None) -> bool:
    """Whether ``url``'s host (by the name connected, IDNA, or as written) and port are
    on ``allowed_hosts`` (``--download-allowed-hosts``; None: every host is)."""
    if allowed_hosts is None:
        return True
    host = url.raw_host.decode("ascii")  # the name connected: IDNA, no brackets
    port = url.port or (443 if url.scheme == "https" else 80)
    return any(addresses.host_allowed(name, port, allowed_hosts) for name in (host, url.host))


def check_url(url: str) -> None:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise InvalidRequest(f"Invalid download URL: {exc}", param="url") from exc
    if parsed.scheme not in ("http", "https"):
        raise InvalidRequest(
            f"The download URL must be http or https, not '{parsed.scheme or '(none)'}'.",
            param="url",
        )
    if not parsed.host:
        raise InvalidRequest("The download URL has no host.", param="url")


def file_name(url: str, filename: str | None) -> str:
    """The file's name in the models folder: checked to stay a plain ``.gguf`` name there."""
    param = "filename" if filename is not None else "url"
    if filename is not None:
        name = filename
    else:
        name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    shown = name or "(empty)"
    if not name.endswith(".gguf"):
        raise InvalidRequest(f"The file name '{shown}' does not end in '.gguf'.", param=param)
    if "/" in name or "\\" in name or name in (".", ".."):
        raise InvalidRequest(f"The file name '{shown}' must not contain a path.", param=param)
    if name.startswith("."):
        raise InvalidRequest(f"The file name '{shown}' must not be hidden.", param=param)
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        raise InvalidRequest("The file name contains control characters.", param=param)
    if len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX_BYTES:
        raise InvalidRequest("The file name is too long.", param=param)
    return name


def check_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise InvalidRequest("'sha256' must be 64 hexadecimal digits.", param="sha256")
    return sha256.lower()
