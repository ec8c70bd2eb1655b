"""The page's files, read once and served from memory: ``/`` and ``/ui/<name>``.

Every answer carries a strict Content-Security-Policy (only this origin, no
inline script or style; images also as ``data:`` URIs, the user's own attachments) and a strong ETag, the file's content hash: the page
and its own modules are revalidated (``no-cache``, a 304 when unchanged); the
vendored libraries, whose file names carry their version, are cached for good.
An asset is looked up by its exact name in a table, never on the file system,
so no path can reach another file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.core.errors import NotFound

INDEX = "index.html"
PREFIX = "/ui/"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
REVALIDATE = "no-cache"
FOREVER = "public, max-age=31536000, immutable"


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str
    etag: str
    cache_control: str

    @classmethod
    def of(cls, name: str, body: bytes) -> Asset:
        media_type = MEDIA_TYPES[name[name.rfind(".") :]]
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        cache = FOREVER if name.startswith("vendor/") else REVALIDATE
        return cls(body, media_type, etag, cache)

    def headers(self) -> dict[str, str]:
        return {
            "etag": self.etag,
            "cache-control": self.cache_control,
            "content-security-policy": CSP,
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
        }

    def matches(self, if_none_match: str | None) -> bool:
        """Whether an ``If-None-Match`` header names this version (weakly, as RFC 9110
        compares for a GET)."""
        if if_none_match is None:
            return False
        tags = (tag.strip().removeprefix("W/") for tag in if_none_match.split(","))
        return any(tag in ("*", self.etag) for tag in tags)


class WebPage:
    """The chat page: its routes, and the paths anyone may fetch without an API key.

    Example::

        page = WebPage.load()
        app = Starlette(routes=[*api_routes, *page.routes])
        BearerAuth(app, keys, public=page.paths | {"/health"})
    """

    def __init__(self, files: Mapping[str, bytes]) -> None:
        """``files``: name (``"app.js"``, ``"vendor/x.js"``) -> content; one is ``index.html``."""
        self._assets = {name: Asset.of(name, body) for name, body in files.items()}
        self._index = self._assets.pop(INDEX)

    @classmethod
    def load(cls) -> WebPage:
        """The files shipped in ``sluice/web/static`` (those of a served kind)."""
        root = resources.files("sluice.web") / "static"
        return cls(dict(_walk(root, "")))

    @property
    def paths(self) -> frozenset[str]:
        """Every path the page is made of, exactly: what the key check lets through."""
        return frozenset({"/", *(PREFIX + name for name in self._assets)})

    @property
    def routes(self) -> list[Route]:
        # GET routes answer HEAD too (Starlette adds it).
        return [
            Route("/", self.index, methods=["GET"]),
            Route(PREFIX + "{name:path}", self.asset, methods=["GET"]),
        ]

    async def index(self, request: Request) -> Response:
        return _send(request, self._index)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        asset = self._assets.get(name)
        if asset is None:
            raise NotFound(f"No file '{name}' in the web page.")
        return _send(request, asset)


def _send(request: Request, asset: Asset) -> Response:
    if asset.matches(request.headers.get("if-none-match")):
        return Response(status_code=304, headers=asset.headers())
    body = b"" if request.method == "HEAD" else asset.body
    response = Response(body, headers=asset.headers(), media_type=asset.media_type)
    response.headers["content-length"] = str(len(asset.body))
    return response


def _walk(folder: Traversable, prefix: str) -> Iterator[tuple[str, bytes]]:
    for entry in folder.iterdir():
        name = prefix + entry.name
        if entry.is_dir():
            yield from _walk(entry, name + "/")
        elif entry.name[entry.name.rfind(".") :] in MEDIA_TYPES:
            yield name, entry.read_bytes()
