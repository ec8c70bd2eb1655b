"""The chat page's files as the real app serves them: types, CSP, caching, HEAD, 404,
and the key check (the page is public, the API is not, and no path trick reaches it)."""

from __future__ import annotations

import http.client
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from sluice.config import Settings
from sluice.server.app import create_app
from sluice.web import WebPage
from sluice.web.page import CSP
from tests.support.fakes import ScriptedRunner
from tests.support.servers import serve_app

KEY = "sk-web-page-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
STATIC = Path(__file__).parents[2] / "src" / "sluice" / "web" / "static"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    app = create_app(
        Settings(model="scripted", api_key=KEY), runner_factory=lambda s: ScriptedRunner()
    )
    with serve_app(app) as base:
        yield base


@pytest.fixture(scope="module")
def page() -> WebPage:
    return WebPage.load()


def raw_get(base: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``path`` byte for byte (httpx would resolve ``..`` before sending)."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_page_and_its_files_answer_without_a_key(keyed: str, page: WebPage) -> None:
    assert "/" in page.paths and "/ui/app.js" in page.paths
    assert "/ui/vendor/marked-18.2.1.esm.js" in page.paths
    for path in page.paths:
        r = httpx.get(keyed + path, timeout=10)
        assert r.status_code == 200, (path, r.text)
        suffix = ".html" if path == "/" else path[path.rfind(".") :]
        assert r.headers["content-type"] == TYPES[suffix], path
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
        assert re.fullmatch(r'"[0-9a-f]{32}"', r.headers["etag"])
        forever = path.startswith("/ui/vendor/")  # versioned names: cached for good
        assert r.headers["cache-control"] == (
            "public, max-age=31536000, immutable" if forever else "no-cache"
        )
        assert r.content == (STATIC / ("index.html" if path == "/" else path[4:])).read_bytes()


def test_the_api_stays_behind_the_key(keyed: str) -> None:
    for path in ("/v1/models", "/c1/conversations", "/v1/info", "/api/v1/models", "/ui/nope.js"):
        assert httpx.get(keyed + path, timeout=10).status_code == 401, path
        assert httpx.get(keyed + path, headers=AUTH, timeout=10).status_code != 401, path
    assert httpx.get(keyed + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/ui/../v1/models",
        "/ui/%2e%2e/v1/models",
        "/ui/..%2fv1/models",
        "/ui/./app.js",
        "/ui/vendor/../app.js",
        "/ui//app.js",
        "/ui/app.js/",
        "/ui/../../../../etc/passwd",
        "/ui/..%2f..%2fpyproject.toml",
        "/ui/%2fetc%2fpasswd",
        "//",
        "/ui/",
        "/index.html",
        "/ui/index.html",
    ],
)
def test_no_path_trick_gets_past_the_key_or_out_of_the_page(keyed: str, path: str) -> None:
    status, body = raw_get(keyed, path)
    assert status == 401, (path, body)
    status, body = raw_get(keyed, path, AUTH)
    assert status == 404, (path, status, body[:200])
    assert b'"not_found"' in body  # the API's error, never a file or a listing


def test_head_answers_the_headers_without_the_body(keyed: str) -> None:
    for path in ("/", "/ui/app.js"):
        get = httpx.get(keyed + path, timeout=10)
        head = httpx.head(keyed + path, timeout=10)
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(get.content))
        for name in ("etag", "content-type", "content-security-policy", "cache-control"):
            assert head.headers[name] == get.headers[name]


def test_a_known_version_is_not_sent_again(keyed: str) -> None:
    first = httpx.get(keyed + "/ui/style.css", timeout=10)
    etag = first.headers["etag"]
    for header in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        again = httpx.get(keyed + "/ui/style.css", headers={"If-None-Match": header}, timeout=10)
        assert again.status_code == 304 and again.content == b"", header
        assert again.headers["etag"] == etag
    changed = httpx.get(keyed + "/ui/style.css", headers={"If-None-Match": '"old"'}, timeout=10)
    assert changed.status_code == 200 and changed.content == first.content


def test_an_unknown_file_is_a_404(keyed: str) -> None:
    r = httpx.get(keyed + "/ui/nope.js", headers=AUTH, timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    # A file of the folder that is not of a served kind is not served either.
    assert (STATIC / "vendor" / "README.md").exists()
    r = httpx.get(keyed + "/ui/vendor/README.md", headers=AUTH, timeout=10)
    assert r.status_code == 404


def test_the_html_has_no_inline_script_or_style() -> None:
    html = (STATIC / "index.html").read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.DOTALL)
    assert scripts and all('src="/ui/' in attrs and not body.strip() for attrs, body in scripts)
    assert "<style" not in html and not re.search(r"\sstyle=", html)
    assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers
    assert not re.search(r"(src|href)=\"(https?:)?//", html)  # nothing from elsewhere


def test_every_file_the_page_names_is_served(page: WebPage) -> None:
    named = set(re.findall(r'(?:src|href)="(/ui/[^"]+)"', (STATIC / "index.html").read_text()))
    for module in STATIC.glob("*.js"):
        named |= set(re.findall(r'from "(/ui/[^"]+)"', module.read_text()))
    assert len(named) > 8
    assert named <= page.paths, named - page.paths


def test_the_package_data_ships_every_file() -> None:
    pyproject = tomllib.loads((STATIC.parents[3] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["sluice.web"]
    files = [p.relative_to(STATIC.parent) for p in STATIC.rglob("*") if p.is_file()]
    assert files
    for file in files:
        assert any(file.match(pattern) for pattern in patterns), file
