"""A real headless Chromium (Debian's ``chromium``) driven by Playwright's Python API.

Tests that need it skip when ``/usr/bin/chromium`` (or Playwright) is missing, with
the reason, unless ``SLUICE_REQUIRE_BROWSER=1`` (CI) makes that a failure. The
flags keep Chromium off the network: without them it calls Google's hosts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("SLUICE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"SLUICE_REQUIRE_BROWSER=1, but {reason}")
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator[Any]:
    """A launched headless Chromium (a Playwright ``Browser``), closed on exit."""
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshots_dir() -> Path:
    """Where the browser tests save their screenshots (printed; ``SLUICE_SCREENSHOTS``
    chooses it)."""
    chosen = os.environ.get("SLUICE_SCREENSHOTS")
    path = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="sluice-web-shots-"))
    path.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {path}")
    return path
