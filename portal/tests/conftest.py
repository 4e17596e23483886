"""Fixtures shared by the portal's browser tests: Debian's headless Chromium via Playwright."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Chromium as the machines here allow it: no sandbox as root, no background connections
# (the network is closed and they would be refused at every start).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                    reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def browser():
    # Playwright's sync API runs an event loop in this thread; the ORM calls made by the
    # test itself are ordinary synchronous ones.
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
