"""The web chat page: ``GET /`` and its assets under ``/ui/``, build-free and all local.

The page is plain HTML, CSS and ES modules (``static/``), with two vendored,
pinned libraries (``static/vendor/README.md``). It talks to the server's own
API (``/c1``, ``/v1/info``, ``/api/v1/models/load``) like any other client, so
it holds nothing secret and is served without an API key; the API stays
behind the keys.
"""

from sluice.web.page import WebPage

__all__ = ["WebPage"]
