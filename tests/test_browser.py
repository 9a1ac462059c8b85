"""The real page in a real browser: Playwright drives Debian's Chromium on a `launch.py` server
with the embedded model, as a user would. One server (with its own fresh chat store) and one
browser serve the module; each test opens its own tab. Answers are greedy (the page's default),
so the texts can be compared. A passing run leaves the README's screenshot in assets/screenshot.png.

Skipped without /usr/bin/chromium (`apt-get install chromium`; .ci/run installs it) or Playwright."""

import os
import re
import shutil
import time

import pytest

from core.config import DRAFTERS, STRATEGY_LABELS
from app.chats import LISTED
from app.store import ChatStore
from app.ui import MONITOR_S
from tests.browser import (ANSWERED, CHROMIUM, SCREENSHOT, SEE_MS, STATS, VIEWPORT, act, answers, ask, button, expect,
                           new_chat, open_page, questions, seen, set_max_tokens, shown_chat, stats, sync_api)
from tests.conftest import start_aerie

pytestmark = [pytest.mark.slow, pytest.mark.late,
              pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")]


@pytest.fixture(scope="module")
def server(embedded_dir, cache_dir, tmp_path_factory):
    """-> (base URL, the server's chat store)."""
    chats = tmp_path_factory.mktemp("aerie-data") / "chats.sqlite3"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # --chats: the page saves there, not in the user's chats (the page, not compiling: test_cpu_quant.py)
    proc, url = start_aerie(cache_dir, "--no-compile", "--chats", str(chats), env=env)
    try:
        yield url, ChatStore(chats)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM))
        yield b
        b.close()


@pytest.fixture(scope="module")
def shot(request, tmp_path_factory):
    """Where a test leaves the README's screenshot; it replaces assets/screenshot.png only when
    every test of this module passed."""
    path = tmp_path_factory.mktemp("shot") / "screenshot.png"
    failed = request.session.testsfailed
    yield path
    if path.is_file() and request.session.testsfailed == failed:
        shutil.copyfile(path, SCREENSHOT)


@pytest.fixture
def page(browser, server):
    """A fresh tab on the page, loaded: the latest chat (if any) shown, the monitor filled."""
    context = browser.new_context(viewport=VIEWPORT)
    tab = context.new_page()
    tab.set_default_timeout(SEE_MS)
    open_page(tab, server)
    yield tab
    context.close()


def test_an_answer_streams_with_its_speed_and_the_monitor_plots_it(page, shot):
    new_chat(page)
    states = ask(page, "Give me three tips for better sleep.")
    streaming = [s for s in states if not s["idle"] and s["bots"] == 1 and s["last"]]
    texts = list(dict.fromkeys(s["last"] for s in streaming))
    assert len(texts) >= 3, states                             # the answer grew in front of the user
    assert len(texts[-1]) > len(texts[0])
    assert any(STATS.search(s["stats"]) for s in streaming)    # the speed shows while it streams
    assert len(answers(page).last.inner_text().strip()) >= len(texts[-1])
    expect(questions(page)).to_have_text(["Give me three tips for better sleep."])
    tokens, tok_s = stats(page)
    assert tokens > 5 and tok_s > 0
    expect(button(page, "Stop")).to_be_hidden()
    expect(page.locator("#aerie-plot")).to_contain_text("tok/s")  # the monitor's next refresh plots it
    expect(shown_chat(page)).to_have_text("Give me three tips for better sleep.")
    page.locator("button.label-wrap", has_text="Settings").click()  # folded, so the monitor is in view
    expect(page.locator("#aerie-memory")).to_be_in_viewport()
    page.screenshot(path=str(shot))


def test_stop_ends_a_long_answer_and_brings_send_back(page):
    new_chat(page)
    mark = len(seen(page))
    page.locator("#aerie-input textarea").fill("Write a long story about a dragon.")
    page.locator("#aerie-input textarea").press("Enter")
    stop = button(page, "Stop")
    expect(stop).to_be_visible()
    inert = "() => document.getElementById('aerie-chats').inert"
    assert page.evaluate(inert), "the chat list can be used while an answer streams into the chat shown"
    page.wait_for_function("(from) => window.aerieSeen.slice(from).some(s => s.last.length > 150)", arg=mark)
    stop.click()
    page.wait_for_function(ANSWERED, arg=mark)
    expect(button(page, "Send")).to_be_visible()
    expect(button(page, "Send")).to_be_enabled()
    assert not page.evaluate(inert)
    expect(stop).to_be_hidden()
    expect(page.locator("#aerie-stats")).to_contain_text("stopped")
    tokens, _ = stats(page)
    assert tokens < 512                                        # well before the page's max new tokens
    kept, after = answers(page).last.inner_text().strip(), len(seen(page))
    page.wait_for_timeout(3000)                                # time in which a running answer would grow
    assert answers(page).last.inner_text().strip() == kept and len(kept) > 150
    assert all(s["last"] == kept for s in seen(page, after))


def test_the_monitor_pauses_while_an_answer_streams(page):
    """Its refreshes (unqueued calls, every MONITOR_S) stop while the engine decodes and resume after."""
    new_chat(page)
    calls: list[float] = []
    page.on("request", lambda r: calls.append(time.monotonic()) if r.method == "POST" and "/run/" in r.url else None)
    page.locator("#aerie-input textarea").fill("Write a long story about a dragon.")
    page.locator("#aerie-input textarea").press("Enter")
    stop = button(page, "Stop")
    expect(stop).to_be_visible()
    started = time.monotonic()
    page.wait_for_timeout(2500 * MONITOR_S)                   # two and a half refresh periods
    expect(stop).to_be_visible()                               # still answering
    assert not [t for t in calls if t > started], "the monitor refreshed during the answer"
    # Stop if it still shows: the story may end by itself in the meantime (a click waiting for a
    # Stop that went away timed out in CI once decoding got faster).
    page.evaluate("""() => [...document.querySelectorAll('#aerie-input button')]
      .find(b => b.textContent.trim() === 'Stop' && b.offsetParent !== null)?.click()""")
    expect(button(page, "Send")).to_be_enabled()
    ended = time.monotonic()
    page.wait_for_timeout(1500 * MONITOR_S)
    assert [t for t in calls if t > ended], "the monitor did not resume after the answer"


def test_regenerate_replaces_the_last_answer(page):
    new_chat(page)
    set_max_tokens(page, 24)
    ask(page, "Tell me about the moon.")
    first = answers(page).last.inner_text().strip()
    assert stats(page)[0] == 24
    set_max_tokens(page, 10)
    states = act(page, button(page, "Regenerate").click)
    assert any(s["bots"] == 0 for s in states)                 # the old answer went away first
    expect(answers(page)).to_have_count(1)
    expect(questions(page)).to_have_count(1)
    again = answers(page).last.inner_text().strip()
    assert stats(page)[0] == 10 and "max tokens reached" in page.locator("#aerie-stats").inner_text()
    assert again and again != first and first.startswith(again)  # greedy: the same start, cut shorter


def test_the_browser_keeps_no_copy_of_the_chats(page):
    """The store holds the chats; Gradio's run history (on by default) would keep every answer's
    inputs and outputs in localStorage too, out of reach of Delete, and rewrite it at each answer."""
    new_chat(page)
    set_max_tokens(page, 12)
    ask(page, "Name a shape.")   # a question of its own: the module's tests share one chat list
    answer = answers(page).last.inner_text().strip()
    kept = page.evaluate("() => Object.keys(localStorage).map(k => [k, localStorage.getItem(k)])")
    assert answer and kept, "no answer, or nothing at all in localStorage (the saved settings should be)"
    assert not [k for k, v in kept if "run-history" in k or "Name a shape" in v or answer in v]


def test_switching_chats_shows_each_ones_history(page):
    set_max_tokens(page, 8)
    new_chat(page)
    ask(page, "What is the capital of France?")
    first_answer = answers(page).last.inner_text()
    new_chat(page)
    ask(page, "Name a colour.")
    chats = page.locator("#aerie-chats label")
    expect(chats.filter(has_text="What is the capital of France?")).to_have_count(1)
    chats.filter(has_text="What is the capital of France?").click()
    expect(questions(page)).to_have_text(["What is the capital of France?"])
    expect(answers(page)).to_have_text([first_answer])
    expect(shown_chat(page)).to_have_text("What is the capital of France?")
    chats.filter(has_text="Name a colour.").click()
    expect(questions(page)).to_have_text(["Name a colour."])
    expect(answers(page)).to_have_count(1)
    expect(shown_chat(page)).to_have_text("Name a colour.")


def test_a_reload_reopens_the_latest_chat(page, server):
    set_max_tokens(page, 8)
    new_chat(page)
    ask(page, "Say hello.")
    answer = answers(page).last.inner_text()
    open_page(page, server, reload=True)
    expect(page.locator("#aerie-chats label").first).to_have_text("Say hello.")  # newest first
    expect(shown_chat(page)).to_have_text("Say hello.")
    expect(questions(page)).to_have_text(["Say hello."])
    expect(answers(page)).to_have_text([answer])
    # The sampling settings the user changed come back too (kept in the browser).
    expect(page.get_by_label("range slider for Max new tokens")).to_have_value("8")


def test_a_reload_mid_answer_leaves_the_answer_marked_interrupted(page, server):
    _, store = server
    new_chat(page)
    mark = len(seen(page))
    page.locator("#aerie-input textarea").fill("Write a long story about a cat.")
    page.locator("#aerie-input textarea").press("Enter")
    page.wait_for_function("(from) => window.aerieSeen.slice(from).some(s => s.last.length > 40)", arg=mark)
    page.reload()
    # The server closes the answer once it sees the page gone and saves it marked; the reloaded
    # page may have opened the chat before that, so wait for the store, then reload again.
    chat, finish = store.chats()[0], None
    for _ in range(SEE_MS // 250):
        finish = (store.messages(chat.id)[-1].meta or {}).get("finish")
        if finish:
            break
        page.wait_for_timeout(250)
    assert finish == "interrupted"
    open_page(page, server, reload=True)
    expect(shown_chat(page)).to_have_text("Write a long story about a cat.")
    expect(page.locator("#aerie-chat")).to_contain_text(" · interrupted")


def test_the_monitor_shows_memory_and_the_tuner(page):
    memory = page.locator("#aerie-memory")
    expect(memory).to_contain_text(re.compile(r"RAM [\d.]+ GiB · CPU \d+% of \d+ cores"))
    expect(memory).to_contain_text("Weights")
    expect(page.locator("#aerie-tuning")).to_contain_text(re.compile(r"Tuner: \S+"))
    # The header names the drafter in words, not as core's identifiers (eagle, prompt_lookup).
    # Whichever the tuner holds now (it tries Medusa, lookahead... after a stopped answer).
    words = "|".join(map(re.escape, STRATEGY_LABELS.values()))
    expect(page.locator("#aerie-header")).to_contain_text(re.compile(rf"· ({words})\s*$"))


def test_the_bench_page_client_times_answers_the_page_shows(server, browser):
    """bench --page's client (core/served_page.py): each prompt in a new chat, greedy, its tokens
    and text as the page holds them: the API's answer to the same request, character for character."""
    from core.served import ServedClient
    from core.served_page import PageClient

    client = PageClient(server[0], browser=browser)
    try:
        first = client.answer("Name three colours as a numbered list.", 24)
        second = client.answer("Name three fruits.", 12)
        questions_shown = client.tab.locator("#aerie-chat [data-testid='user']").all_inner_texts()
        ab = client.ab()   # the page's A/B of the second answer, read from its verdict
    finally:
        client.close()
    assert 1 <= first.tokens <= 24 and 1 <= second.tokens <= 12 and first.seconds > 0
    assert first.text and second.text and first.strategy in DRAFTERS   # the drafter its stats line names
    # The page's default request is the API's (no system prompt, greedy), and its text the answer's
    # own, not the drawn Markdown's (which drops a list's numbers).
    assert first.text == ServedClient(server[0]).answer("Name three colours as a numbered list.", 24, None).text.rstrip()
    assert questions_shown == ["Name three fruits."]   # a new chat for each prompt
    assert ab.identical is True and (ab.ratio is None) == (second.tokens <= 1)   # greedy: plain's text, token for token


# Counts the frames the page asks the browser for (installed before the page's own scripts, so
# the page's FRAME_THROTTLE wraps it: what it counts reached the browser).
COUNT_FRAMES = """(() => { const frame = window.requestAnimationFrame.bind(window); window.__frames = 0;
  window.requestAnimationFrame = (callback) => { window.__frames += 1; return frame(callback); }; })();"""


def test_the_idle_page_asks_for_a_few_frames_a_second_not_sixty(browser, server):
    """Gradio's start-up status tracker, removed while its timer runs, asks for a frame every
    frame for the page's life (app/page_scripts.py FRAME_THROTTLE); an idle page drawing 60 times
    a second took ~10% of a core from the engine. With the throttle: its timer's 4 a second."""
    context = browser.new_context(viewport=VIEWPORT)
    try:
        tab = context.new_page()
        tab.add_init_script(COUNT_FRAMES)
        tab.set_default_timeout(SEE_MS)
        open_page(tab, server)
        tab.wait_for_timeout(4000)   # Gradio's loader animates for ~3 s after the page has loaded
        before = tab.evaluate("() => window.__frames")
        tab.wait_for_timeout(3000)
        asked = tab.evaluate("() => window.__frames") - before
    finally:
        context.close()
    assert asked <= 45, f"the idle page asked for {asked} frames in 3 s"


def test_find_opens_a_chat_older_than_the_list_holds(page, server):
    """The list holds the most recent chats (chats.LISTED, so that each list sent costs the page
    little however many are saved); Find lists an older one by a word of its messages, and
    picking it shows it. The module's last test: it leaves LISTED chats newer than the others'."""
    _, store = server
    old = store.create_chat("Birds")
    store.sync(old.id, [{"role": "user", "content": "Tell me about herons"}, {"role": "assistant", "content": "Herons wade."}])
    for i in range(LISTED):
        store.create_chat(f"Filler {i}")
    open_page(page, server, reload=True)
    chats = page.locator("#aerie-chats label")
    expect(chats).to_have_count(LISTED)
    expect(chats.filter(has_text="Birds")).to_have_count(0)
    page.locator("#aerie-find input, #aerie-find textarea").press_sequentially("HERONS")   # typed: a fill sends no input event
    expect(chats).to_have_text([f"Filler {LISTED - 1}", "Birds"])   # the chat shown stays listed
    chats.filter(has_text="Birds").click()
    expect(questions(page)).to_have_text(["Tell me about herons"])
    expect(shown_chat(page)).to_have_text("Birds")
