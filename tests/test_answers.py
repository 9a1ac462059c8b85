"""Per-answer statistics, drafted-token highlighting and A/B with plain decoding (app/answers.py,
app/compare.py) with a scripted service and a store in tmp_path: no browser, no torch."""

import json
import sqlite3
from types import SimpleNamespace

import gradio as gr
import pytest

from app import answers, chats, compare, handlers
from app.answers import Answer
from app.handlers import Cancels
from app.store import ChatStore
from core.config import ReplyEvent, ReplyStats
from tests.fakes import FakeService, session

GREEDY = ("Be brief.", 0.0, 1.0, 0, -1, 64, "")  # system prompt, temperature, top_p, top_k, seed, max new, stops
SAMPLED = ("Be brief.", 0.7, 0.9, 0, 5, 64, "")
ROUNDS = (((("Hello", False),)), (("<b>", True), (" & ", True), ("\t", False)),
          ((" friend\n\n**x**", True), (".", False)))
TEXT = "Hello<b> & \t friend\n\n**x**."


class SpanService:
    """Streams ROUNDS, one event a round, speculating at 2 tok/s; a plain run (strategy="plain")
    streams `plain_text` word by word at 1 tok/s."""

    def __init__(self, plain_text=TEXT, stop_plain_after=None):
        self.plain_text, self.stop_plain_after = plain_text, stop_plain_after
        self.calls = []

    def reply(self, messages, system_prompt, sampling, stop_strings, cancel, strategy=None, every_s=0.0):
        self.calls.append(SimpleNamespace(messages=messages, system_prompt=system_prompt, sampling=sampling,
                                          stop_strings=stop_strings, strategy=strategy, cancel=cancel))
        plain = strategy == "plain"
        rounds = [((w, False),) for w in self.plain_text.split(" ")] if plain else ROUNDS
        rounds = [r if i == 0 or not plain else ((" " + r[0][0], False),) for i, r in enumerate(rounds)]
        for n, spans in enumerate(rounds, 1):
            if cancel.is_set():
                yield ReplyEvent.of((), self.stats(n - 1, len(rounds), plain), finish="cancelled")
                return
            yield ReplyEvent.of(spans, self.stats(n, len(rounds), plain))
            if plain and n == self.stop_plain_after:
                cancel.set()  # as if the user pressed Stop
        yield ReplyEvent.of((), self.stats(len(rounds), len(rounds), plain), finish="eos")

    @staticmethod
    def stats(n, rounds, plain):
        """12 tokens over the answer, whatever the number of rounds; the first run reads its prompt
        in 1 s, the plain rerun finds it in the cache."""
        tokens, prefill_s = 12 * n // rounds, 0.0 if plain else 1.0
        return ReplyStats(new_tokens=tokens, elapsed_s=prefill_s + tokens / (1.0 if plain else 2.0), target_steps=n,
                          drafted=3 * n, accepted=0 if plain else 2 * n, strategy="plain" if plain else "eagle",
                          prefill_s=prefill_s)


@pytest.fixture
def store(tmp_path):
    return ChatStore(tmp_path / "chats.sqlite3")


def ask(store, service, settings=GREEDY, highlight=False, chat_id=None):
    return list(chats.respond(store, service, Cancels(), chat_id, "Say hello", [], *settings, highlight,
                              request=session()))


def run_ab(store, service, chat_id, highlight=False, cancels=None):
    return list(compare.compare(store, service, cancels or Cancels(), chat_id, highlight, request=session()))


def test_answer_keeps_which_characters_were_drafted():
    answer = Answer()
    for spans in ROUNDS:
        answer = answer.add(ReplyEvent.of(spans, ReplyStats()))
    assert answer.text == TEXT
    assert [answer.text[a:b] for a, b in answer.drafted] == ["<b> & ", " friend\n\n**x**"]
    plain = Answer().add(ReplyEvent("no spans given", ReplyStats()))
    assert plain.text == "no spans given" and plain.drafted == ()
    with pytest.raises(ValueError, match="add up"):
        ReplyEvent("abc", ReplyStats(), spans=(("ab", True),))


def test_highlighting_marks_drafted_text_and_round_trips():
    answer = Answer()
    for spans in ROUNDS:
        answer = answer.add(ReplyEvent.of(spans, ReplyStats()))
    shown = answers.highlighted(answer.text, answer.drafted)
    assert shown == ('<div class="aerie-spans">Hello<mark class="aerie-drafted">&lt;b&gt; &amp; </mark>&#9;'
                     '<mark class="aerie-drafted"> friend<br><br>**x**</mark>.</div>')
    assert "\n" not in shown  # one line: Markdown passes an HTML block through until a blank line
    assert answers.plain_text(shown) == TEXT
    assert answers.plain_text("**plain** <b>answer</b>") == "**plain** <b>answer</b>"


def test_each_answer_shows_its_stats_under_it_and_they_survive_a_reload(store):
    outputs = ask(store, SpanService())
    view = outputs[-1][0]
    assert [m["role"] for m in view] == ["user", "assistant", "assistant"]
    answer, row = view[1], view[2]
    assert answer == {"role": "assistant", "content": {"type": "text", "text": TEXT}}   # a part: drawn as is
    title = row["metadata"]["title"]
    assert row["metadata"]["status"] == "done"  # collapsed: one line under the answer
    assert title == ("**12** tokens · **1.7** tok/s · accepted length **4.00** · speedup **—** vs plain · "
                     "EAGLE head")
    assert "Acceptance **67%**: 6 of 9" in row["content"]
    reopened = chats.open_latest(ChatStore(store.path), True)[1]  # a restart, highlight on
    assert reopened[2] == row and "<mark" in reopened[1]["content"]["text"]
    assert answers.plain_text(reopened[1]["content"]["text"]) == TEXT


def test_stats_rows_and_highlighting_never_reach_the_model(store):
    service = SpanService()
    view = ask(store, service, highlight=True)[-1][0]
    assert "<mark" in view[1]["content"]["text"]
    # The page's own copy of the chat (the fallback when the store fails) reads back as plain text.
    assert handlers.normalise_history(view) == [{"role": "user", "content": "Say hello"},
                                                {"role": "assistant", "content": TEXT}]
    (chat,) = store.chats()
    list(chats.respond(store, service, Cancels(), chat.id, "Again", view, *GREEDY, True, request=session()))
    assert service.calls[-1].messages == [{"role": "user", "content": "Say hello"},
                                          {"role": "assistant", "content": TEXT}, {"role": "user", "content": "Again"}]
    saved = store.messages(chat.id)
    assert saved[1].content == TEXT and saved[1].meta["drafted"] == [[5, 11], [12, 26]]
    assert saved[1].meta["request"]["sampling"]["temperature"] == 0.0 and saved[3].meta is not None


def test_exports_hold_the_plain_text(store):
    ask(store, SpanService(), highlight=True)
    (chat,) = store.chats()
    markdown = store.export_markdown(chat.id)
    assert TEXT.strip() in markdown and "<mark" not in markdown and "tok/s" not in markdown
    doc = json.loads(store.export_json(chat.id))
    assert doc["messages"][1]["content"] == TEXT and "meta" not in doc["messages"][0]
    assert doc["messages"][1]["meta"]["stats"]["new_tokens"] == 12


def test_redraw_toggles_highlighting_from_the_store(store, toasts):
    ask(store, SpanService())
    (chat,) = store.chats()
    marked, unmarked = chats.redraw(store, chat.id, True), chats.redraw(store, chat.id, False)
    assert marked[1]["content"]["text"].count('<mark class="aerie-drafted">') == 2
    assert unmarked[1]["content"]["text"] == TEXT and marked[2] == unmarked[2]
    store.delete(chat.id)  # e.g. from another tab
    assert chats.redraw(store, chat.id, True) == chats.gr.skip() and "no longer exists" in toasts[-1][1]


def test_ab_reruns_the_same_request_plainly_and_compares(store):
    service = SpanService()
    ask(store, service)
    (chat,) = store.chats()
    before = store.messages(chat.id)
    outputs = run_ab(store, service, chat.id)
    spec_call, plain_call = service.calls
    assert plain_call.strategy == "plain" and spec_call.strategy is None
    assert plain_call.messages == [{"role": "user", "content": "Say hello"}]  # the answer is not in the prompt
    assert (plain_call.sampling, plain_call.system_prompt) == (spec_call.sampling, "Be brief.")
    # the chat is left as it is while the plain run streams; its progress is the stats line's
    assert len(outputs) > 3 and all(chat == chats.gr.skip() for chat, _ in outputs[:-1])
    assert all(line.startswith("A/B, plain decoding: **") for _, line in outputs[:-1]), outputs[-2][1]
    view, line = outputs[-1]
    assert line == "A/B vs plain decoding: **2.00×** the speed · identical text: **yes**"
    ab = view[-1]
    assert ab["metadata"] == {"title": line}  # open: the comparison shows without a click
    # 2x after the first token; whole answers (12 / 7 s against 12 / 12 s) would say 1.71x, the
    # spec run's prefill against the rerun's cached prompt
    assert "| tok/s after it | 1.8 | 0.9 |" in ab["content"] and "| wall time | 7.00 s | 12.00 s |" in ab["content"]
    assert "| first token after | 1.00 s | 0.00 s |" in ab["content"]
    assert "Identical text: **yes**" in ab["content"]
    after = store.messages(chat.id)
    assert [(m.role, m.content) for m in after] == [(m.role, m.content) for m in before]  # nothing replaced
    assert after[1].meta["ab"]["text"] == TEXT and after[1].meta["stats"] == before[1].meta["stats"]
    assert chats.open_latest(store)[1][-1] == ab  # the comparison comes back after a reload


def test_ab_says_when_greedy_texts_differ(store):
    ask(store, SpanService())
    (chat,) = store.chats()
    view, line = run_ab(store, SpanService(plain_text="Hello<b> & \t friend, other."), chat.id)[-1]
    assert line.endswith("identical text: **no**")
    assert "only the first 19 characters agree" in view[-1]["content"]


def test_ab_under_sampling_says_texts_differ_by_design(store):
    ask(store, SpanService(), settings=SAMPLED)
    (chat,) = store.chats()
    service = SpanService(plain_text="Something else entirely.")
    view, line = run_ab(store, service, chat.id)[-1]
    assert line == "A/B vs plain decoding: **2.00×** the speed · sampling: texts differ by design"
    assert "differ by design" in view[-1]["content"] and "Identical text" not in view[-1]["content"]
    assert service.calls[0].sampling.temperature == 0.7 and service.calls[0].sampling.seed == 5


def test_a_race_shows_its_progress_in_the_stats_line_and_draws_the_chat_at_its_end(store):
    from app import race

    class TwoDrafters(SpanService):
        drafters = ("plain", "eagle")

    ask(store, SpanService())
    (chat,) = store.chats()
    outputs = list(race.race(store, TwoDrafters(), Cancels(), chat.id, False, request=session()))
    assert len(outputs) > 3 and all(chat == chats.gr.skip() for chat, _ in outputs[:-1])
    assert outputs[-1][0][-1]["metadata"]["title"].startswith("Race of 2 drafters")
    assert outputs[0][1].startswith("Race, plain decoding (1 of 2): **") and "Race, EAGLE" in outputs[-2][1]
    assert outputs[-1][1].startswith("Race of 2 drafters")


def test_a_stopped_ab_compares_nothing(store, toasts):
    ask(store, SpanService())
    (chat,) = store.chats()
    view, line = run_ab(store, SpanService(stop_plain_after=1), chat.id)[-1]
    assert line == "" and len(view) == 3 and "ab" not in store.messages(chat.id)[1].meta
    assert "nothing was compared" in toasts[-1][1]


@pytest.mark.parametrize("setup, why", [
    ("none", "send a message first"), ("user_last", "no answer to compare"),
    ("old_answer", "saved before Aerie kept answer statistics"), ("stopped", "stopped before it ended"),
    ("interrupted", "stopped before it ended"),
])
def test_ab_explains_why_it_cannot_compare(store, toasts, setup, why):
    chat_id = None
    if setup != "none":
        chat_id = store.create_chat().id
        last = {"user_last": [], "old_answer": [{"role": "assistant", "content": "old"}],
                "stopped": [{"role": "assistant", "content": "cut", "meta": {
                    "stats": {}, "finish": "cancelled", "drafted": [], "request": {}}}],
                "interrupted": [{"role": "assistant", "content": "cut", "meta": {
                    "stats": {}, "finish": "interrupted", "drafted": [], "request": {}}}]}[setup]
        store.sync(chat_id, [{"role": "user", "content": "Q"}, *last])
    service = SpanService()
    assert run_ab(store, service, chat_id) == [(chats.gr.skip(), chats.gr.skip())]
    assert service.calls == [] and why in toasts[-1][1]


def test_store_migrates_a_version_1_file(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as con:
        for statement in __import__("app.store", fromlist=["_MIGRATIONS"])._MIGRATIONS[1]:
            con.execute(statement)
        con.execute("INSERT INTO chats (title, created, updated) VALUES ('old', 1, 1)")
        con.execute("INSERT INTO messages (chat_id, role, content, created) VALUES (1, 'user', 'hi', 1)")
        con.execute("PRAGMA user_version = 1")
    store = ChatStore(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
    (old,) = store.messages(1)
    assert (old.content, old.meta) == ("hi", None)
    store.sync(1, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "meta": {"a": [1]}}])
    assert store.messages(1)[1].meta == {"a": [1]}


def test_build_ui_wires_ab_and_the_highlight_toggle(store):
    from app.ui import build_ui

    demo = build_ui(FakeService(), store=store)
    fns = {fn.api_name or fn.name: fn for fn in demo.fns.values()}
    ids = {getattr(block, "elem_id", None) for block in demo.blocks.values()}
    assert {"aerie-ab", "aerie-highlight", "aerie-chat", "aerie-stats", "aerie-input"} <= ids
    assert [o.elem_id for o in fns["ab"].outputs] == ["aerie-chat", "aerie-stats"]
    assert fns["respond"].inputs[-1].elem_id == fns["regenerate"].inputs[-1].elem_id == "aerie-highlight"
    assert [i.elem_id for i in fns["redraw"].inputs][1:] == ["aerie-highlight"]
    clear = fns["clear"]
    assert len(clear.outputs) == 2 + len(handlers.controls("idle"))  # chat, stats, every locked control


def test_the_page_draws_an_answer_as_the_model_wrote_it():
    """Gradio dedents a str message (inspect.cleandoc): a JSON answer cut off by the token limit,
    every line after the first indented, lost its indentation in the page. A text part keeps it."""
    cut_off = '{\n  "a": 1,\n  "b": [\n    2'
    chat = [{"role": "user", "content": "  indented\n  question"}, {"role": "assistant", "content": cut_off}]
    drawn = gr.Chatbot().postprocess(answers.view(chat)).root
    assert [m.content[0].text for m in drawn] == ["  indented\n  question", cut_off]
    assert gr.Chatbot().postprocess(chat).root[1].content[0].text != cut_off   # why: a str is dedented
