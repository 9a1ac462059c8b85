"""The page of an Aerie started with a key, in a real browser: a login form first, then the chat
works as without a key (an answer streams, an export downloads), all through the page's cookie.
Skipped as tests/test_browser.py is (no Chromium or Playwright)."""

import os

import pytest

from tests.conftest import start_aerie
from tests.fakes import KEY
from tests.browser import ANSWERS, CHROMIUM, RECORDER, SEE_MS, VIEWPORT, ask, button, expect, stats, sync_api

pytestmark = [pytest.mark.slow, pytest.mark.late,
              pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")]


@pytest.fixture(scope="module")
def keyed_server(embedded_dir, cache_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("aerie-data")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "XDG_DATA_HOME": str(data), "AERIE_API_KEY": KEY}
    proc, url = start_aerie(cache_dir, "--no-compile", env=env)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_page_asks_for_the_key_then_works(keyed_server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        tab = browser.new_context(viewport=VIEWPORT, accept_downloads=True).new_page()
        tab.set_default_timeout(SEE_MS)
        tab.goto(keyed_server)
        tab.get_by_label("API key").fill("a guess")
        tab.get_by_role("button", name="Open").click()
        expect(tab.get_by_role("alert")).to_contain_text("not the key")
        tab.get_by_label("API key").fill(KEY)
        tab.get_by_role("button", name="Open").click()
        expect(tab.locator("#aerie-memory")).to_contain_text("RAM")  # the page and its unqueued events
        tab.evaluate(RECORDER, ANSWERS)
        ask(tab, "Say hello.")
        assert stats(tab)[0] > 0  # the queue streamed an answer
        button(tab, "Export .json").click()
        with tab.expect_download() as download:
            tab.locator("a[download]").last.click()
        assert "Say hello." in download.value.path().read_text(encoding="utf-8")
        browser.close()
