"""The page of an Aerie started with a key, in a real browser: a login form first, then the chat
works as without a key (an answer streams, an export downloads), all through the page's cookie.
Skipped as tests/test_browser.py is (no Chromium or Playwright)."""

import pytest

from tests.fakes import KEY
from tests.browser import ANSWERS, CHROMIUM, RECORDER, SEE_MS, VIEWPORT, ask, button, expect, stats, sync_api

pytestmark = [pytest.mark.slow, pytest.mark.late,
              pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")]


def test_the_page_asks_for_the_key_then_works(keyed_aerie):
    """On the server test_api.py's real test asked through the API (conftest `keyed_aerie`)."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        tab = browser.new_context(viewport=VIEWPORT, accept_downloads=True).new_page()
        tab.set_default_timeout(SEE_MS)
        tab.goto(keyed_aerie)
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
