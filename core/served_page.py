"""`launch.py bench --serve --page`: the bench's prompts typed into the live server's page, in
Chromium driven by Playwright, as a user asks them: the gap between the engine's speed and what
the page delivers (its streaming updates, their rendering, the browser sharing the cores) is
measured on every such run.

Each prompt starts a new chat, is typed and sent with Enter, and its time runs from the key press
until Send comes back (the answer's end is drawn), on the page's own clock. Its tokens are the
stats line's count under the chat, its text what the answer's Copy button copies: the message as
the page holds it, Markdown and all (the drawn bubble's text drops a list's numbers and the
like: 53 of 80 MT-bench answers read word for word so). The page decodes with the drafter
its dropdown holds: the tuner's choice (auto), so it stands against the bench's `eagle`. Chromium
runs headless, as the bench has no screen; it still lays out and paints every update.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from core.config import STRATEGY_LABELS
from core.errors import AerieError
from core.served import ServedAnswer

CHROMIUM = Path("/usr/bin/chromium")
WAIT_MS = 600_000     # the longest answer the bench waits for
STATS = re.compile(r"(\d+) tokens? · [\d.]+ tok/s")
SPEEDUP = re.compile(r"speedup ([\d.]+)× vs plain")
DRAFTER = re.compile("vs plain · (" + "|".join(map(re.escape, STRATEGY_LABELS.values())) + ")")   # the drafter it ran
DRAFTER_NAMES = {label: name for name, label in STRATEGY_LABELS.items()}
AB = re.compile(r"A/B vs plain decoding: ([\d.]+|—)× the speed · (identical text: (yes|no)|sampling)")
ANSWERS = "#aerie-chat [data-testid='bot']:not(:has(.thought-group))"   # answers, less their statistics rows
# Clicks the Copy button under the last answer (the first after its row: its statistics row has one too).
COPY_ANSWER = """(answers) => { const row = [...document.querySelectorAll(answers)].pop()?.closest('.message-row');
  for (let next = row?.nextElementSibling; next; next = next.nextElementSibling) {
    const copy = next.querySelector("button[aria-label='Copy message']");
    if (copy) { copy.click(); return true; }
  }
  return false; }"""
# What a Copy button writes is kept in the page instead of the system clipboard, which a headless
# browser may not grant.
KEEP_COPIED = "navigator.clipboard.writeText = async (text) => { window.__aerieCopied = text; };"
# True once Send is shown and enabled: the page is idle, the last answer drawn.
IDLE = """() => [...document.querySelectorAll('#aerie-input button')]
  .some(b => b.textContent.trim() === 'Send' && !b.disabled && b.offsetParent !== null)"""
# Resolves window.__aerieAnswered with the seconds from the next `start` event in the page (a key
# press, a click) until it has left idle and come back: the page's own clock, checked on each
# change of the input row rather than polled (Playwright's waits poll every animation frame, which
# keeps headless Chromium drawing beside the engine, and add their round trips to the time).
ANSWERED = """({limit, start}) => { window.__aerieAnswered = new Promise((resolve, reject) => {
  const idle = %s; let left = false, pressed = null;
  document.addEventListener(start, () => { pressed = pressed ?? performance.now(); }, {capture: true, once: true});
  const watch = new MutationObserver(() => {
    if (!idle()) left = true;
    else if (left) { watch.disconnect(); clearTimeout(late); resolve((performance.now() - pressed) / 1000); }
  });
  const late = setTimeout(() => { watch.disconnect(); reject(new Error('no answer within the limit')); }, limit);
  // Send's state changes there; checking it on every change of the chat would force a layout of
  // the page each time (offsetParent) while the engine decodes.
  watch.observe(document.querySelector('#aerie-input'), {subtree: true, childList: true, attributes: true});
}); }""" % IDLE


@dataclass(frozen=True)
class PageAB:
    """The page's A/B of its last answer: the speed ratio it measured (None: a run made one token
    or none) and whether plain decoding's text was the same (None under sampling)."""
    ratio: float | None
    identical: bool | None


class PageClient:
    """Chromium on the page of a running Aerie server at `url`; close() ends what it started. A
    caller that runs Playwright already passes its `browser` (one Playwright per thread)."""

    def __init__(self, url: str, chromium: Path = CHROMIUM, browser=None):
        self._playwright = self._browser = None
        if browser is None:
            try:
                from playwright.sync_api import sync_playwright
            except ImportError as e:
                raise AerieError("bench --page drives Chromium with Playwright: pip install playwright") from e
            if not chromium.is_file():
                raise AerieError(f"bench --page needs Chromium at {chromium} (apt-get install chromium)")
            self._playwright = sync_playwright().start()
            browser = self._browser = self._playwright.chromium.launch(executable_path=str(chromium))
        self._context = browser.new_context(viewport={"width": 1280, "height": 800})
        self._context.add_init_script(KEEP_COPIED)
        self.tab = self._context.new_page()
        self.tab.goto(url)
        self.tab.locator("#aerie-memory").filter(has_text="RAM").wait_for(timeout=WAIT_MS)
        self._max_new: int | None = None

    def answer(self, text: str, max_new: int, strategy: str | None = None) -> ServedAnswer:
        """Ask `text` in a new chat with at most `max_new` tokens, greedily (the page's default
        temperature is set to 0 here); -> the answer as the page showed it."""
        if strategy is not None:
            raise AerieError("The page decodes with its dropdown's drafter (auto); the bench asks it for no other.")
        tab = self.tab
        self._settings(max_new)
        tab.get_by_role("button", name="New chat", exact=True).click()
        tab.locator("#aerie-chat [data-testid='user']").first.wait_for(state="detached", timeout=WAIT_MS)
        box = tab.locator("#aerie-input textarea")
        box.fill(text)
        box.focus()
        tab.evaluate(ANSWERED, {"limit": WAIT_MS, "start": "keydown"})
        tab.keyboard.press("Enter")
        seconds = tab.evaluate("() => window.__aerieAnswered")
        stats = tab.locator("#aerie-stats").inner_text()
        found = STATS.search(stats)
        if not found:
            raise AerieError(f"The page's answer ended without its statistics: {stats!r}")
        speedup, drafter = SPEEDUP.search(stats), DRAFTER.search(stats)
        # server_s 0: the page does not say how long the service took, only the stats line's own tok/s
        return ServedAnswer(self._copied(), int(found[1]), seconds, 0.0, DRAFTER_NAMES[drafter[1]] if drafter else "page",
                            float(speedup[1]) if speedup else None)

    def _copied(self) -> str:
        """The last answer's text through its Copy button, less whitespace at its end (the bench
        compares it with its own text so)."""
        self.tab.evaluate("() => { window.__aerieCopied = null; }")
        clicked = self.tab.evaluate(COPY_ANSWER, ANSWERS)
        copied = self.tab.evaluate("() => window.__aerieCopied")
        if not clicked or copied is None:
            raise AerieError("The page's Copy button under the answer copied nothing.")
        return copied.rstrip()

    def ab(self) -> PageAB:
        """Press A/B vs plain under the last answer and read its verdict, once the page is idle."""
        tab = self.tab
        tab.evaluate(ANSWERED, {"limit": WAIT_MS, "start": "click"})
        tab.locator("#aerie-ab").click()
        tab.evaluate("() => window.__aerieAnswered")
        found = AB.search(tab.locator("#aerie-chat").inner_text())
        if not found:
            raise AerieError("The page's A/B ended without its verdict under the answer.")
        return PageAB(None if found[1] == "—" else float(found[1]), None if found[3] is None else found[3] == "yes")

    def _settings(self, max_new: int) -> None:
        """Max new tokens as the bench's, temperature 0 (greedy, as the bench)."""
        if self._max_new == max_new:
            return
        for label, value in (("Max new tokens", max_new), ("Temperature", 0)):
            box = self.tab.get_by_label(f"number input for {label}")
            box.fill(str(value))
            box.press("Enter")
        self._max_new = max_new

    def close(self) -> None:
        self._context.close()
        if self._browser is not None:
            self._browser.close()
            self._playwright.stop()
