"""The browser tests skip without Chromium, except where SLUICE_REQUIRE_BROWSER=1 (CI)
makes a missing browser a failure."""

from __future__ import annotations

import pytest

from tests.support import browser


def test_a_missing_chromium_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(browser, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("SLUICE_REQUIRE_BROWSER", raising=False)
    missing = pytest.raises(pytest.skip.Exception, match="no Chromium at /nonexistent/chromium")
    with missing, browser.chromium():
        pass


def test_a_missing_chromium_fails_where_it_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(browser, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.setenv("SLUICE_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="SLUICE_REQUIRE_BROWSER=1"), browser.chromium():
        pass
