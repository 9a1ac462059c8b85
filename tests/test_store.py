"""The chat store (app/store.py): operations, export formats, persistence, and surviving a kill."""

import json
import os
import signal
import stat
import sqlite3
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest

from app.store import (SCHEMA_VERSION, TITLE_CHARS, UNTITLED, ChatNotFoundError, ChatStore, StoreError,
                       default_store_path, title_from)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def store(tmp_path):
    return ChatStore(tmp_path / "data" / "chats.sqlite3")


def pairs(store, chat_id):
    return [(m.role, m.content) for m in store.messages(chat_id)]


def test_a_new_chat_is_titled_by_its_first_user_message(store):
    chat = store.create_chat()
    assert chat.title == UNTITLED and store.messages(chat.id) == []
    store.append(chat.id, "user", "  What is   speculative\ndecoding, in short?  ")
    store.append(chat.id, "assistant", "A draft proposes, the target checks.")
    store.append(chat.id, "user", "Thanks")
    assert store.chat(chat.id).title == "What is speculative decoding, in short?"
    assert pairs(store, chat.id)[0] == ("user", "  What is   speculative\ndecoding, in short?  ")
    named = store.create_chat("My notes")
    store.append(named.id, "user", "hello")
    assert store.chat(named.id).title == "My notes"


def test_title_from_shortens_at_a_word():
    long = "Explain " + "the quick brown fox jumps over the lazy dog " * 3
    title = title_from(long)
    assert title.endswith("…") and len(title) <= TITLE_CHARS + 1
    assert long.startswith(title[:-1]) and not title[:-1].endswith(" ")
    assert title_from("x" * 100) == "x" * TITLE_CHARS + "…"
    assert title_from("   ") == UNTITLED


def test_chats_are_listed_newest_first(store):
    first, second, third = (store.create_chat(name) for name in ("one", "two", "three"))
    assert [c.title for c in store.chats()] == ["three", "two", "one"]
    store.append(first.id, "user", "back to the first")
    assert [c.id for c in store.chats()] == [first.id, third.id, second.id]
    assert store.chats()[0].updated >= store.chats()[1].updated


def test_chats_take_a_limit_and_find_text_in_titles_and_messages(store):
    lisbon, rome, other = store.create_chat("Trip to Lisbon"), store.create_chat("Rome"), store.create_chat("100%_done")
    store.sync(rome.id, [{"role": "user", "content": "Plan a weekend"}, {"role": "assistant", "content": "Visit LISBON too"}])
    assert [c.id for c in store.chats(2)] == [rome.id, other.id]      # newest first, at most 2
    assert [c.id for c in store.chats(containing="lisbon")] == [rome.id, lisbon.id]   # a message or the title, any case
    assert [c.id for c in store.chats(1, "lisbon")] == [rome.id]
    assert [c.id for c in store.chats(containing="0%_")] == [other.id]  # % and _ are text, not wildcards
    assert store.chats(containing="1%0") == [] and store.chats(containing="Paris") == []


def test_update_last_changes_only_the_streaming_answer(store):
    chat = store.create_chat()
    store.append(chat.id, "user", "Hi")
    store.append(chat.id, "assistant", "Hel")
    created = store.messages(chat.id)[1].created
    store.update_last(chat.id, "Hello there")
    assert pairs(store, chat.id) == [("user", "Hi"), ("assistant", "Hello there")]
    assert store.messages(chat.id)[1].created == created
    store.append(chat.id, "user", "again")
    with pytest.raises(ValueError, match="not an answer"):
        store.update_last(chat.id, "would overwrite the user's message")
    with pytest.raises(ValueError, match="role"):
        store.append(chat.id, "system", "no")


def test_sync_writes_only_the_tail_that_differs(store):
    chat = store.create_chat()
    base = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"}]
    store.sync(chat.id, base)
    first_ids = [row[0] for row in sqlite3.connect(store.path).execute("SELECT id FROM messages ORDER BY id")]
    for text in ("N", "New", "New answer"):  # streaming: the answer grows in place
        store.sync(chat.id, base + [{"role": "assistant", "content": text}])
    ids = [row[0] for row in sqlite3.connect(store.path).execute("SELECT id FROM messages ORDER BY id")]
    assert ids[:3] == first_ids and len(ids) == 4
    assert pairs(store, chat.id)[-1] == ("assistant", "New answer")
    store.sync(chat.id, base)  # a failed or regenerated answer: dropped
    assert pairs(store, chat.id) == [("user", "Q1"), ("assistant", "A1"), ("user", "Q2")]
    store.sync(chat.id, base[:1] + [{"role": "assistant", "content": "A1 edited"}])
    assert pairs(store, chat.id) == [("user", "Q1"), ("assistant", "A1 edited")]
    updated = store.chat(chat.id).updated
    store.sync(chat.id, base[:1] + [{"role": "assistant", "content": "A1 edited"}])
    assert store.chat(chat.id).updated == updated  # nothing changed, nothing written


def test_rename_and_delete(store):
    keep, gone = store.create_chat(), store.create_chat()
    store.append(gone.id, "user", "secret")
    assert store.rename(keep.id, "  Trip   plans ").title == "Trip plans"
    assert store.chat(keep.id).title == "Trip plans"
    with pytest.raises(StoreError, match="needs a title"):
        store.rename(keep.id, "   ")
    store.delete(gone.id)
    assert [c.id for c in store.chats()] == [keep.id]
    count = sqlite3.connect(store.path).execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    assert count == 0  # the messages went with their chat
    for call in (lambda: store.messages(gone.id), lambda: store.append(gone.id, "user", "x"),
                 lambda: store.rename(gone.id, "x"), lambda: store.delete(gone.id),
                 lambda: store.export_json(gone.id)):
        with pytest.raises(ChatNotFoundError, match="no longer exists"):
            call()


def test_export_json(store):
    chat = store.create_chat()
    store.sync(chat.id, [{"role": "user", "content": "Grüße, 2+2?"}, {"role": "assistant", "content": "4"}])
    doc = json.loads(store.export_json(chat.id))
    assert doc["format"] == "aerie-chat" and doc["version"] == 1 and doc["title"] == "Grüße, 2+2?"
    assert [(m["role"], m["content"]) for m in doc["messages"]] == [("user", "Grüße, 2+2?"), ("assistant", "4")]
    for when in [doc["created"], doc["updated"], *(m["created"] for m in doc["messages"])]:
        assert datetime.fromisoformat(when).tzinfo is not None
    assert "Grüße" in store.export_json(chat.id)  # readable, not \u-escaped


def test_export_markdown(store):
    chat = store.create_chat("Maths")
    store.sync(chat.id, [{"role": "user", "content": "What is 2+2?\n"}, {"role": "assistant", "content": "**4**"}])
    text = store.export_markdown(chat.id)
    assert text.startswith("# Maths\n\n*A chat with Aerie, 2 messages, last changed ")
    assert text.index("## You\n\nWhat is 2+2?\n") < text.index("## Aerie\n\n**4**\n")
    assert text.endswith("**4**\n")


def test_chats_persist_across_reopening(tmp_path):
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    chat = store.create_chat()
    store.sync(chat.id, [{"role": "user", "content": "remember me"}, {"role": "assistant", "content": "I will"}])
    del store
    again = ChatStore(path)
    assert [c.title for c in again.chats()] == ["remember me"]
    assert pairs(again, chat.id) == [("user", "remember me"), ("assistant", "I will")]
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_file_from_a_newer_aerie_or_not_a_database_is_refused_clearly(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    ChatStore(newer)
    with sqlite3.connect(newer) as con:
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer Aerie"):
        ChatStore(newer)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match=str(junk)):
        ChatStore(junk)


def test_threads_write_at_once(store):
    chats = [store.create_chat() for _ in range(4)]
    errors = []

    def talk(chat_id):
        try:
            for i in range(25):
                store.append(chat_id, "user" if i % 2 == 0 else "assistant", f"{chat_id}:{i}")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(c.id,)) for c in chats]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for c in chats:
        assert [m.content for m in store.messages(c.id)] == [f"{c.id}:{i}" for i in range(25)]


CHILD = """
import sys, time
from app.store import ChatStore
store = ChatStore(sys.argv[1])
chat = store.create_chat()
store.sync(chat.id, [{"role": "user", "content": "Tell me a long story"}])
text = ""
for i in range(100000):
    text += f" w{i}"
    store.sync(chat.id, [{"role": "user", "content": "Tell me a long story"}, {"role": "assistant", "content": text}])
    print(i, flush=True)
    time.sleep(0.002)
"""


def test_a_killed_writer_keeps_every_committed_answer_text(tmp_path):
    path = tmp_path / "chats.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        seen = [int(child.stdout.readline()) for _ in range(60)]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    store = ChatStore(path)  # opens cleanly after the kill
    (chat,) = store.chats()
    user, answer = store.messages(chat.id)
    assert user.content == "Tell me a long story"
    words = answer.content.split()
    assert words == [f"w{i}" for i in range(len(words))] and len(words) > seen[-1]


@pytest.mark.parametrize("platform, env, expected", [
    ("linux", {"XDG_DATA_HOME": "/data/me"}, "/data/me/aerie/chats.sqlite3"),
    ("linux", {}, "/home/me/.local/share/aerie/chats.sqlite3"),
    ("linux", {"XDG_DATA_HOME": "relative/dir"}, "/home/me/.local/share/aerie/chats.sqlite3"),
    ("darwin", {"XDG_DATA_HOME": "/ignored"}, "/home/me/Library/Application Support/Aerie/chats.sqlite3"),
    ("win32", {"APPDATA": "/c/Users/me/AppData/Roaming"}, "/c/Users/me/AppData/Roaming/Aerie/chats.sqlite3"),
])
def test_default_store_path(platform, env, expected):
    assert default_store_path(env, platform, Path("/home/me")) == Path(expected)


@pytest.mark.skipif(os.name == "nt", reason="POSIX modes")
def test_the_store_is_readable_by_the_user_alone(tmp_path):
    path = tmp_path / "new" / "chats.sqlite3"
    store = ChatStore(path)
    store.append(store.create_chat().id, "user", "private")
    for file in (path, *path.parent.glob("chats.sqlite3-*")):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.skipif(os.name == "nt", reason="POSIX modes")
def test_an_existing_store_with_wide_modes_is_narrowed(tmp_path):
    path = tmp_path / "old" / "chats.sqlite3"
    store = ChatStore(path)
    store.append(store.create_chat().id, "user", "private")
    os.chmod(path.parent, 0o755)
    for file in path.parent.iterdir():
        os.chmod(file, 0o644)
    assert ChatStore(path).chats()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in path.parent.iterdir()} == {0o600}
