"""A headless Chromium through chromedriver for the pages' browser tests (the chat page, the fleet page): the
`browser` fixture (tests/conftest.py) opens one `BROWSER_WIDTH` px wide. Needs Debian's `chromium` and
`chromium-driver` (`.ci/run` installs them when missing). Without them a test is skipped, unless
LLMGW_REQUIRE_BROWSER=1 (as in CI), where their absence fails it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from typing import Iterator

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
BROWSER_WIDTH = 400


def require_browser() -> None:
    missing = [name for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not path]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium (pip)")
    if missing:
        why = f"needs {', '.join(missing)}: apt-get install chromium chromium-driver (.ci/run does)"
        if os.environ.get("LLMGW_REQUIRE_BROWSER") == "1":
            pytest.fail(why)
        pytest.skip(why)


def open_browser() -> Iterator[object]:
    """A selenium Chrome driver, quit and its profile removed when the generator is closed."""
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={BROWSER_WIDTH},900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_window_size(BROWSER_WIDTH, 900)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
