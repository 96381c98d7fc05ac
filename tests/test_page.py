"""The server's page at `/`, as a person sees it: Debian's headless Chromium (chromium and
chromium-driver, which `.ci/run` installs) loads it from a `treespec serve` subprocess, sends a
message, and must see streamed text and a drawn draft tree with its accepted path; the test
keeps a screenshot (TREESPEC_PAGE_SCREENSHOT names where, default the test's tmp dir)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from .servers import start_server  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


def test_the_page_chats_and_draws_each_rounds_tree(tmp_path_factory, tmp_path):
    gen = start_server(tmp_path_factory, "float32")
    srv = next(gen)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    try:
        browser.get(srv["base"] + "/")
        assert browser.title == "treespec"
        browser.find_element(By.ID, "width").send_keys("2")
        browser.find_element(By.ID, "depth").send_keys("3")
        browser.find_element(By.ID, "message").send_keys("def quicksort(xs):")
        browser.find_element(By.ID, "send").click()
        wait = WebDriverWait(browser, 60)
        wait.until(
            lambda b: (
                b.find_element(By.ID, "send").is_enabled() and b.find_elements(By.CSS_SELECTOR, ".assistant")
            )
        )
        reply = browser.find_element(By.CSS_SELECTOR, ".assistant").text
        assert reply.strip(), browser.find_element(By.ID, "log").text
        label = browser.find_element(By.ID, "round-label").text
        assert label.startswith("round ") and " of " in label, label
        nodes = browser.find_elements(By.CSS_SELECTOR, "#tree-svg g.node")
        root = browser.find_elements(By.CSS_SELECTOR, "#tree-svg g.node.root.on-path")
        final = browser.find_elements(By.CSS_SELECTOR, "#tree-svg g.node.correction, #tree-svg g.node.bonus")
        assert len(root) == 1 and len(final) == 1 and len(nodes) >= 3, len(
            nodes
        )  # root, drafts, the final token
        tip = browser.find_elements(
            By.CSS_SELECTOR, "#tree-svg g.node.rejected title, #tree-svg g.node.accepted title"
        )
        assert all(" p " in t.get_attribute("textContent") for t in tip)
        assert browser.find_elements(By.CSS_SELECTOR, "#per-round rect")  # the tokens-per-round chart
        shot = Path(os.environ.get("TREESPEC_PAGE_SCREENSHOT") or tmp_path / "page.png")
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        browser.quit()
        srv["proc"].terminate()
        srv["proc"].wait(30)
