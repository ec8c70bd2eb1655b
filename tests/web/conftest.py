"""The web page's tests: one headless Chromium per module, one screenshots folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import chromium, screenshots_dir


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (skips, or fails under SLUICE_REQUIRE_BROWSER=1, without one)."""
    with chromium() as b:
        yield b


@pytest.fixture(scope="session")
def shots() -> Path:
    """Where screenshots go (printed once)."""
    return screenshots_dir()
