"""The Chats panel (app/chats.py): answers saved as they stream, and the list's actions, with the
scripted FakeService of test_ui_handlers and a store in tmp_path."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import gradio as gr
import pytest

from app import chats, handlers
from app.handlers import Cancels
from app.store import ChatStore, StoreError
from tests.fakes import SETTINGS, FakeService, session

pytestmark = pytest.mark.usefixtures("every_event")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(tmp_path):
    return ChatStore(tmp_path / "chats.sqlite3")


def stored(store, chat_id):
    return [{"role": m.role, "content": m.content} for m in store.messages(chat_id)]


def say(store, service, chat_id, message, history=(), cancels=None):
    return list(chats.respond(store, service, cancels or Cancels(), chat_id, message, list(history), *SETTINGS,
                              request=session()))


def text_rows(view):
    """The chatbot's messages without the stats and A/B rows under answers (highlight off), each
    content a text part (answers.verbatim): as {"role", "content": its text}."""
    assert all(m["content"]["type"] == "text" for m in view if "metadata" not in m)
    return [{"role": m["role"], "content": m["content"]["text"]} for m in view if "metadata" not in m]


def choices(update):
    return [(label, value) for label, value in update["choices"]]


def test_a_first_message_creates_the_chat_and_lists_it(store):
    outputs = say(store, FakeService(), None, "Plan a trip to Lisbon")
    (chat,) = store.chats()
    assert chat.title == "Plan a trip to Lisbon"
    listed = outputs[-1][2]  # once the answer is done: its redraw would take the cores from the prefill
    assert choices(listed) == [("Plan a trip to Lisbon", chat.id)] and listed["value"] == chat.id
    assert outputs[-1][3] == "Plan a trip to Lisbon"  # the title box of the new chat
    # with the last update again, now with the answer's stats row under it (left out while it streamed)
    assert outputs[-1][1] == outputs[-2][1] and text_rows(outputs[-1][0]) == text_rows(outputs[-2][0])
    assert [m.get("metadata") is not None for m in outputs[-1][0]] == [False, False, True]
    assert all("metadata" not in m for m in outputs[-2][0])
    assert all(o[2] == o[3] == gr.skip() for o in outputs[:-1])  # sent once, skipped before
    # The last update, and only it, sets `answered`: the page unlocks its controls on its change.
    assert isinstance(outputs[-1][4], float) and all(o[4] == gr.skip() for o in outputs[:-1])
    assert stored(store, chat.id) == text_rows(outputs[-1][0]) == [
        {"role": "user", "content": "Plan a trip to Lisbon"}, {"role": "assistant", "content": "Hello there, friend."}]


def test_an_answers_end_is_shown_whole_at_once_before_the_service_is_done(store, monkeypatch):
    """The update where the answer has ended carries its stats row, the list and `answered` (the
    page unlocks on it) at once, not after the service's work behind the answer (the tuner's turn);
    the store has it all once the stream is done."""
    after: list[str] = []
    respond = handlers.respond

    def tracked(*args, **kwargs):   # the service's own end, after its last event
        yield from respond(*args, **kwargs)
        after.append("stream ended")
    monkeypatch.setattr(handlers, "respond", tracked)
    seen = []
    for output in chats.respond(store, FakeService(), Cancels(), None, "Plan a trip", [], *SETTINGS, request=session()):
        seen.append((output, list(after)))
    (last, ended_then), *_ = seen[::-1]
    assert isinstance(last[4], float) and ended_then == [] and after == ["stream ended"]
    assert [m.get("metadata") is not None for m in last[0]] == [False, False, True]
    assert all(not isinstance(o[4], float) for o, _ in seen[:-1])
    (chat,) = store.chats()
    assert stored(store, chat.id) == text_rows(last[0])


def test_answers_start_from_the_stored_chat_not_the_page(store):
    chat = store.create_chat()
    store.sync(chat.id, [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1 (other tab)"}])
    service = FakeService(words=("A2",))
    stale_page = [{"role": "user", "content": "Q1"}]
    outputs = say(store, service, chat.id, "Q2", stale_page)
    assert service.calls[0].messages[:2] == [{"role": "user", "content": "Q1"},
                                            {"role": "assistant", "content": "A1 (other tab)"}]
    assert [m["content"] for m in stored(store, chat.id)] == ["Q1", "A1 (other tab)", "Q2", "A2"]
    assert text_rows(outputs[-1][0]) == stored(store, chat.id)
    # The newest chat already: the page's list stays as it is, and an existing chat's title box too.
    assert outputs[-1][2] == outputs[-1][3] == gr.skip()


def test_an_older_chat_answered_moves_to_the_top_of_the_list(store):
    older, newer = store.create_chat("older"), store.create_chat("newer")
    store.sync(older.id, [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}])
    store.sync(newer.id, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    outputs = say(store, FakeService(words=("A2",)), older.id, "Q2")
    listed = outputs[-1][2]
    assert [c[1] for c in choices(listed)] == [older.id, newer.id] and listed["value"] == older.id
    assert outputs[-1][3] == gr.skip()


def test_an_empty_message_stores_nothing(store):
    outputs = say(store, FakeService(), None, "   ")
    assert len(outputs) == 1 and store.chats() == []
    assert isinstance(outputs[0][4], float)  # `answered`: the page undoes Send's locks


def test_stop_keeps_the_partial_answer_in_the_store(store):
    service, cancels = FakeService(), Cancels()
    stream = chats.respond(store, service, cancels, None, "Hi", [], *SETTINGS, request=session("me"))
    next(stream), next(stream)  # "Hello", "Hello there" (the page drew the user's turn itself)
    cancels.cancel("me")
    last = list(stream)[-1]
    (chat,) = store.chats()
    assert text_rows(last[0])[-1] == {"role": "assistant", "content": "Hello there"}
    assert stored(store, chat.id) == text_rows(last[0])


def test_a_failed_answer_is_stored_as_the_page_shows_it(store, toasts):
    chat = store.create_chat()
    store.sync(chat.id, [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}])
    service = FakeService(fail_at=3, error=RuntimeError("boom"))
    outputs = say(store, service, chat.id, "Q2")
    assert stored(store, chat.id) == text_rows(outputs[-1][0]) == [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    assert toasts[-1][0] == "warning"


def test_while_streaming_saves_are_throttled_and_the_last_state_is_flushed(store, monkeypatch):
    monkeypatch.setattr(chats, "SAVE_EVERY_S", 3600.0)
    stream = chats.respond(store, FakeService(), Cancels(), None, "Hi", [], *SETTINGS, request=session())
    shown = [next(stream) for _ in range(3)]  # "Hello", "Hello there", "Hello there," (the page drew the user's turn)
    (chat,) = store.chats()
    assert stored(store, chat.id) == [{"role": "user", "content": "Hi"}]  # saved at once, before the answer
    stream.close()  # the page went away mid-answer
    assert stored(store, chat.id) == text_rows(shown[-1][0])


def test_a_killed_app_keeps_what_was_shown_before_the_last_save_interval(store, monkeypatch):
    monkeypatch.setattr(chats, "SAVE_EVERY_S", 0.0)
    stream = chats.respond(store, FakeService(), Cancels(), None, "Hi", [], *SETTINGS, request=session())
    shown = [next(stream) for _ in range(2)]
    # A kill runs no `finally`: only what was saved while streaming is there when the app restarts.
    again = ChatStore(store.path)
    (chat,) = again.chats()
    assert stored(again, chat.id) == text_rows(shown[-1][0]) == [{"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello there"}]
    del stream


CHILD = """
import sys, time
from app import chats, handlers
from app.handlers import Cancels
from app.store import ChatStore
from core.config import ReplyEvent, ReplyStats

class Slow:
    def reply(self, messages, system_prompt, sampling, stops, cancel, every_s=0.0):
        for i in range(100000):
            time.sleep(0.01)
            yield ReplyEvent(f" w{i}", ReplyStats(new_tokens=i + 1, elapsed_s=1.0, target_steps=i + 1))

store = ChatStore(sys.argv[1])
settings = ("", 0.0, 1.0, 0, -1, 100000, "")
for chat, *_ in chats.respond(store, Slow(), Cancels(), None, "Tell me a story", [], *settings):
    last = [m for m in chat if "metadata" not in m][-1]  # the answer, not the stats row under it
    print(time.monotonic(), len(last["content"]["text"].split()) if last["role"] == "assistant" else 0, flush=True)
"""


def test_killing_the_app_mid_answer_keeps_what_was_shown(tmp_path):
    """A real process, killed with SIGKILL while it streams: the store keeps every word the page had
    shown more than SAVE_EVERY_S (plus slack for a busy machine) before the kill."""
    path = tmp_path / "chats.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    shown = []  # (when, words shown)
    try:
        while not shown or shown[-1][0] - shown[0][0] < 2.0:
            line = child.stdout.readline()
            assert line, "the child stopped early"
            shown.append(tuple(map(float, line.split())))
        killed_at = time.monotonic()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    safe = max(words for when, words in shown if when <= killed_at - chats.SAVE_EVERY_S - 0.5)
    store = ChatStore(path)
    (chat,) = store.chats()
    user, answer = store.messages(chat.id)
    assert user.content == "Tell me a story" and safe > 0
    assert len(answer.content.split()) >= safe


@pytest.mark.parametrize("save_every_s", [0.0, 3600.0])  # the cut-off state saved already, or not yet
def test_an_answer_cut_off_by_a_closed_page_says_so_when_reopened(store, monkeypatch, save_every_s):
    monkeypatch.setattr(chats, "SAVE_EVERY_S", save_every_s)
    stream = chats.respond(store, FakeService(), Cancels(), None, "Hi", [], *SETTINGS, request=session())
    shown = [next(stream) for _ in range(2)]  # "Hello", "Hello there"
    stream.close()  # the page was closed or reloaded: Gradio closes the generator
    (chat,) = store.chats()
    answer = store.messages(chat.id)[-1]
    assert (answer.content, answer.meta["finish"]) == ("Hello there", "interrupted")
    assert stored(store, chat.id) == text_rows(shown[-1][0])
    _, reopened, *_ = chats.open_latest(ChatStore(store.path))
    row = reopened[-1]  # the stats row under the answer
    assert row["metadata"]["title"].endswith(" · interrupted") and "the page was closed" in row["content"]


def test_answers_that_ended_are_not_marked_interrupted(store):
    say(store, FakeService(), None, "Hi")
    cancels = Cancels()
    stream = chats.respond(store, FakeService(), cancels, store.chats()[0].id, "Again", [], *SETTINGS,
                           request=session("me"))
    next(stream), next(stream)
    cancels.cancel("me")  # Stop
    list(stream)
    finishes = [m.meta["finish"] for m in store.messages(store.chats()[0].id) if m.role == "assistant"]
    assert finishes == ["eos", "cancelled"]


def test_regenerate_replaces_the_stored_answer(store):
    chat = store.create_chat()
    store.sync(chat.id, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "old"}])
    outputs = list(chats.regenerate(store, FakeService(words=("new",)), Cancels(), chat.id, [], *SETTINGS,
                                    request=session()))
    assert stored(store, chat.id) == text_rows(outputs[-1][0]) == [{"role": "user", "content": "Q"},
                                                       {"role": "assistant", "content": "new"}]


def test_a_failing_store_warns_once_and_the_answer_still_streams(store, toasts, monkeypatch):
    def broken(*args):
        raise StoreError("The saved chats in /x could not be written: disk I/O error.")

    monkeypatch.setattr(store, "sync", broken)
    monkeypatch.setattr(chats, "SAVE_EVERY_S", 0.0)
    outputs = say(store, FakeService(), None, "Hi")
    assert text_rows(outputs[-1][0])[-1] == {"role": "assistant", "content": "Hello there, friend."}
    warnings = [t for t in toasts if t[0] == "warning"]
    assert len(warnings) == 1 and warnings[0][1].endswith("This chat is not being saved.")


def test_open_latest_shows_the_most_recently_changed_chat(store):
    assert chats.open_latest(store)[1:4] == ([], "", "")
    older, newer = store.create_chat(), store.create_chat()
    store.sync(newer.id, [{"role": "user", "content": "newer"}])
    store.sync(older.id, [{"role": "user", "content": "older, but touched last"}])
    chat_list, history, stats, title, _ = chats.open_latest(store)
    assert chat_list["value"] == older.id and [c[1] for c in choices(chat_list)] == [older.id, newer.id]
    assert text_rows(history) == [{"role": "user", "content": "older, but touched last"}] and title == "older, but touched last"


def test_the_list_holds_the_most_recent_chats_and_find_lists_others(store, monkeypatch):
    """The list holds chats.LISTED chats and always the one shown; Find lists the chats whose
    title or messages hold its text, and every list later sent to that page (an answer's end, a
    rename) lists what it finds, until the box is empty again."""
    monkeypatch.setattr(chats, "LISTED", 3)
    made = [store.create_chat(f"chat {i}") for i in range(5)]
    for i, chat in enumerate(made):
        store.sync(chat.id, [{"role": "user", "content": f"question {i}" + (" about owls" if i < 2 else "")}])
    ids = [c.id for c in made]
    chat_list = chats.open_latest(store)[0]
    assert [c[1] for c in choices(chat_list)] == ids[:1:-1] and chat_list["value"] == ids[4]
    finds, page = chats.Finds(), session("page")
    found = chats.find(store, finds, " OWLS ", ids[4], request=page)
    assert [c[1] for c in choices(found)] == [ids[4], ids[1], ids[0]] and found["value"] == ids[4]  # the shown chat kept
    assert [c[1] for c in choices(chats.find(store, finds, "owls", None, request=page))] == [ids[1], ids[0]]
    assert finds.text(session("another page")) == ""
    outputs = list(chats.respond(store, FakeService(), Cancels(), None, "Tell me about owls", [], *SETTINGS,
                                 request=page, finds=finds))
    new = store.chats(1)[0].id
    assert [c[1] for c in choices(outputs[-1][2])] == [new, ids[1], ids[0]]  # the answer's list: what Find finds
    renamed, _ = chats.rename(store, ids[3], "Bats", request=page, finds=finds)
    assert [c[1] for c in choices(renamed)] == [ids[3], new, ids[1]]  # the renamed chat shown, kept in
    recent = chats.find(store, finds, "", ids[3], request=page)
    assert [c[1] for c in choices(recent)] == [ids[3], new, ids[4]] and finds.text(page) == ""
    for n in range(chats.Finds.SESSIONS + 1):   # only the latest sessions that searched are kept
        finds.set(session(f"tab {n}"), "owls")
    assert finds.text(session("tab 0")) == "" and finds.text(session(f"tab {chats.Finds.SESSIONS}")) == "owls"


def test_switch_loads_the_picked_chat(store, toasts):
    a, b = store.create_chat("A"), store.create_chat("B")
    store.sync(a.id, [{"role": "user", "content": "in A"}, {"role": "assistant", "content": "reply A"}])
    chat_list, history, stats, title, _ = chats.switch(store, a.id)
    assert chat_list == gr.update(value=a.id) and text_rows(history)[1] == {"role": "assistant", "content": "reply A"}
    assert title == "A" and stats == ""
    store.delete(b.id)  # e.g. from another tab
    chat_list, history, _, title, _ = chats.switch(store, b.id)
    assert chat_list["value"] is None and history == [] and "no longer exists" in toasts[-1][1]
    assert [c[1] for c in choices(chat_list)] == [a.id]


def test_new_chat_stores_nothing_until_the_first_message(store):
    old = store.create_chat("kept")
    chat_list, history, stats, title, _ = chats.new_chat(store)
    assert chat_list == gr.update(value=None) and history == [] and title == ""  # the list itself stays
    assert [c.id for c in store.chats()] == [old.id]


def test_rename(store, toasts):
    chat = store.create_chat()
    store.sync(chat.id, [{"role": "user", "content": "hi"}])
    chat_list, title = chats.rename(store, chat.id, "  Greetings ")
    assert title == "Greetings" and choices(chat_list) == [("Greetings", chat.id)]
    assert chats.rename(store, chat.id, "") == (gr.skip(), gr.skip()) and "needs a title" in toasts[-1][1]
    assert store.chat(chat.id).title == "Greetings"
    chats.rename(store, None, "x")
    assert toasts[-1][0] == "info" and len(store.chats()) == 1


def test_delete_switches_to_the_most_recent_chat_left(store):
    first, second = store.create_chat("first"), store.create_chat("second")
    store.sync(first.id, [{"role": "user", "content": "in first"}])
    chat_list, history, _, title, _ = chats.delete(store, first.id)
    assert chat_list["value"] == second.id and title == "second" and history == []
    assert [c.id for c in store.chats()] == [second.id]
    chat_list, history, _, title, _ = chats.delete(store, second.id)
    assert chat_list["value"] is None and choices(chat_list) == [] and store.chats() == []
    assert chats.delete(store, None) == (gr.skip(),) * 5  # declined, or a chat not yet saved


def test_export_writes_downloadable_files(store, toasts, tmp_path):
    chat = store.create_chat("Trip: Lisbon/Porto?")
    store.sync(chat.id, [{"role": "user", "content": "Plan it"}, {"role": "assistant", "content": "Day 1"}])
    as_json = chats.export(store, tmp_path, "json", chat.id)
    path = Path(as_json["value"])
    assert as_json["visible"] is True and path.name == "Trip-Lisbon-Porto.json"
    assert json.loads(path.read_text(encoding="utf-8"))["messages"][1]["content"] == "Day 1"
    as_md = Path(chats.export(store, tmp_path, "markdown", chat.id)["value"])
    assert as_md.suffix == ".md" and as_md.read_text(encoding="utf-8").startswith("# Trip: Lisbon/Porto?")
    assert chats.export(store, tmp_path, "json", None) == gr.skip() and toasts[-1][0] == "info"


@pytest.mark.skipif(os.name == "nt", reason="POSIX modes")
def test_exports_are_private_and_old_ones_are_deleted(store, tmp_path, monkeypatch):
    chat = store.create_chat("Secret")
    store.sync(chat.id, [{"role": "user", "content": "my plans"}])
    first = Path(chats.export(store, tmp_path, "json", chat.id)["value"])
    assert stat.S_IMODE(first.stat().st_mode) == 0o600 and stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    monkeypatch.setattr(chats, "EXPORT_KEEP_S", -1.0)  # every earlier export counts as copied already
    second = Path(chats.export(store, tmp_path, "markdown", chat.id)["value"])
    assert second.is_file() and not first.parent.exists()


def test_showing_another_chat_hides_the_export_of_the_last_one(store, toasts, tmp_path):
    a, b = store.create_chat("A"), store.create_chat("B")
    store.sync(a.id, [{"role": "user", "content": "in A"}])
    assert chats.export(store, tmp_path, "json", a.id)["visible"] is True
    hidden = {"__type__": "update", "value": None, "visible": False}
    assert chats.switch(store, b.id)[4] == hidden
    assert chats.new_chat(store)[4] == hidden  # New chat, and the chatbot's trash button
    assert chats.delete(store, b.id)[4] == hidden
    assert chats.open_latest(store)[4] == hidden
    assert chats.delete(store, None)[4] == gr.skip()  # a declined delete leaves the chat, and its export


def test_controls_lock_the_list_while_answering():
    assert all(u["interactive"] is False for u in chats.controls("answering"))
    assert all(u["interactive"] is True for u in chats.controls("idle"))


def test_build_ui_wires_the_chats_panel(store):
    from app.ui import build_ui

    demo = build_ui(FakeService(), store=store)
    names = {fn.name for fn in demo.fns.values()}
    assert {"open_latest", "switch", "new_chat", "rename", "delete", "export", "respond", "regenerate", "find"} <= names
    find = next(fn for fn in demo.fns.values() if fn.name == "find")
    assert find.outputs[0].elem_id == "aerie-chats" and find.trigger_mode == "always_last"
    switch = next(fn for fn in demo.fns.values() if fn.name == "switch")
    assert switch.outputs[-1].label == "Exported chat"  # a chat switch reaches the export box
    respond = next(fn for fn in demo.fns.values() if fn.api_name == "respond")
    # chat, stats, the chat list and title, then `answered`, whose change unlocks the page
    assert respond.name == "respond" and len(respond.outputs) == 5 and respond.outputs[-1].elem_id == "aerie-answered"
    assert respond.trigger_mode == "always_last"  # a Send before its completion waits, not dropped
