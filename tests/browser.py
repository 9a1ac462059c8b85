"""What the browser tests share: Chromium and Playwright, the page's selectors and a recorder of
what the chat shows, and the steps a user takes (ask, stop, switch). Importing it skips the
importing module where Playwright is not installed."""

import re
from pathlib import Path

import pytest

# The answers in the chat (the assistant's bubbles, less the rows Gradio draws as accordions: an
# answer's statistics and its A/B comparison) and the browser, as bench --page finds them.
from core.served_page import ANSWERS, CHROMIUM  # noqa: F401 - CHROMIUM: the browser test modules import it from here

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "assets" / "screenshot.png"
VIEWPORT = {"width": 1280, "height": 800}
WAIT_MS = 180_000  # the longest wait for an answer on a busy 2-core CPU
SEE_MS = 60_000    # the longest wait for anything else the page should show

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
expect = sync_api.expect
expect.set_options(timeout=SEE_MS)

# Records what the user sees of the chat each time it changes: how many answers, the last one's
# text, the stats line, and whether Send is back (visible and enabled). Python then waits on and
# reads window.aerieSeen, so no quick change is missed between two polls.
RECORDER = """(answers) => {
  const main = document.querySelector('#aerie-main');
  const state = () => {
    const bots = main.querySelectorAll(answers);
    const send = [...main.querySelectorAll('#aerie-input button')].find(b => b.textContent.trim() === 'Send');
    return {bots: bots.length, last: bots.length ? bots[bots.length - 1].innerText.trim() : '',
            stats: main.querySelector('#aerie-stats').innerText.trim(),
            idle: !!send && !send.disabled && send.offsetParent !== null};
  };
  const seen = window.aerieSeen = [];
  const note = () => {
    const now = state(), last = seen[seen.length - 1];
    if (!last || JSON.stringify(last) !== JSON.stringify(now)) seen.push(now);
  };
  new MutationObserver(note).observe(main, {subtree: true, childList: true, characterData: true, attributes: true});
  note();
}"""
# An answer started after mark `from` (Send went away) and has ended (Send is back).
ANSWERED = "(from) => { const s = window.aerieSeen.slice(from); return s.some(x => !x.idle) && s[s.length - 1].idle; }"
STATS = re.compile(r"(\d+) tokens? · ([\d.]+) tok/s")


def open_page(tab, server, reload: bool = False) -> None:
    """Load (or reload) the page and wait for its load events: until then a click could be undone
    by the late arrival of the latest chat. Then start recording what the chat shows."""
    url, store = server
    tab.reload() if reload else tab.goto(url)
    expect(tab.locator("#aerie-memory")).to_contain_text("RAM")
    latest = store.chats()[:1]
    if latest:
        expect(tab.locator("#aerie-chats input:checked")).to_have_value(str(latest[0].id))
    tab.evaluate(RECORDER, ANSWERS)


def seen(tab, start: int = 0) -> list[dict]:
    return tab.evaluate("(from) => window.aerieSeen.slice(from)", start)


def answers(tab):
    return tab.locator(ANSWERS)


def questions(tab):
    return tab.locator("#aerie-chat [data-testid='user']")


def button(tab, name: str):
    return tab.get_by_role("button", name=name, exact=True)


def set_max_tokens(tab, n: int) -> None:
    box = tab.get_by_label("number input for Max new tokens")
    box.fill(str(n))
    box.press("Enter")
    expect(tab.get_by_label("range slider for Max new tokens")).to_have_value(str(n))


def shown_chat(tab):
    """The chat list's selected entry (its title)."""
    return tab.locator("#aerie-chats label:has(input:checked)")


def new_chat(tab) -> None:
    button(tab, "New chat").click()
    expect(tab.locator("#aerie-chats input:checked")).to_have_count(0)
    expect(questions(tab)).to_have_count(0)


def act(tab, action) -> list[dict]:
    """Do `action` (which starts an answer), wait for the answer to end; -> what was seen meanwhile."""
    mark = len(seen(tab))
    action()
    tab.wait_for_function(ANSWERED, arg=mark, timeout=WAIT_MS)
    return seen(tab, mark)


def ask(tab, text: str) -> list[dict]:
    def send():
        tab.locator("#aerie-input textarea").fill(text)
        tab.locator("#aerie-input textarea").press("Enter")
    return act(tab, send)


def stats(tab) -> tuple[int, float]:
    """(tokens, tok/s) of the stats line under the chat."""
    found = STATS.search(tab.locator("#aerie-stats").inner_text())
    assert found, tab.locator("#aerie-stats").inner_text()
    return int(found[1]), float(found[2])
