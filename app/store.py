"""Saved chats: one SQLite file in the user's data folder, through Python's sqlite3.

Each call opens its own short connection, so Gradio's worker threads never share one, and the
file is in WAL mode, so a page can read while an answer is being written. A committed write
survives the app being killed. The store knows nothing about Gradio or the engine: a chat is a
list of {"role", "content"} messages, an answer optionally with "meta": a JSON object the page
keeps with it (its statistics, which parts the draft wrote), opaque to the store.
"""

import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from app.private import FILE_MODE, narrow, private_file, private_folder
from core.errors import AerieError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # PRAGMA user_version; raise it with a step in _MIGRATIONS
EXPORT_VERSION = 1  # of the JSON export; independent of the file's schema
ROLES = ("user", "assistant")
SPEAKERS = {"user": "You", "assistant": "Aerie"}  # Markdown export headings
UNTITLED = "New chat"
TITLE_CHARS = 48
BUSY_TIMEOUT_S = 10.0  # how long a write waits for another thread's write to finish

_MIGRATIONS = {  # from version N-1 to N: statements run in one transaction
    1: (
        """CREATE TABLE chats (
               id      INTEGER PRIMARY KEY,
               title   TEXT,           -- NULL until set: then from the first user message
               created REAL NOT NULL,  -- Unix seconds
               updated REAL NOT NULL)""",
        """CREATE TABLE messages (
               id      INTEGER PRIMARY KEY,  -- grows along a chat: it orders the messages
               chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
               role    TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
               content TEXT NOT NULL,
               created REAL NOT NULL)""",
        "CREATE INDEX messages_by_chat ON messages(chat_id, id)",
    ),
    2: (
        # JSON object, or NULL: user turns, and answers saved before answers had statistics.
        "ALTER TABLE messages ADD COLUMN meta TEXT",
    ),
}


class StoreError(AerieError):
    """The chat file cannot be read or written; the message says which file and why."""


class ChatNotFoundError(StoreError):
    """The chat is gone, e.g. deleted in another tab."""


@dataclass(frozen=True)
class ChatInfo:
    id: int
    title: str
    created: float  # Unix seconds
    updated: float  # the last change to its messages or title


@dataclass(frozen=True)
class Message:
    role: str      # "user" or "assistant"
    content: str
    created: float
    meta: dict | None = None  # what the page keeps with an answer; never part of its text


def default_store_path(environ: Mapping[str, str] = os.environ, platform: str = sys.platform,
                       home: Path | None = None) -> Path:
    """Where chats live: %APPDATA%\\Aerie, ~/Library/Application Support/Aerie, or
    $XDG_DATA_HOME/aerie (~/.local/share/aerie when unset, as the XDG spec says)."""
    home = Path.home() if home is None else home
    if platform == "win32":
        folder = Path(environ["APPDATA"]) if environ.get("APPDATA") else home / "AppData" / "Roaming"
        return folder / "Aerie" / "chats.sqlite3"
    if platform == "darwin":
        return home / "Library" / "Application Support" / "Aerie" / "chats.sqlite3"
    xdg = environ.get("XDG_DATA_HOME", "")
    folder = Path(xdg) if os.path.isabs(xdg) else home / ".local" / "share"  # the spec ignores relative paths
    return folder / "aerie" / "chats.sqlite3"


def title_from(text: str) -> str:
    """A chat title from its first message: one line, cut at a word near TITLE_CHARS."""
    line = " ".join(text.split())
    if len(line) <= TITLE_CHARS:
        return line or UNTITLED
    cut = line[:TITLE_CHARS].rsplit(" ", 1)[0] if " " in line[:TITLE_CHARS] else line[:TITLE_CHARS]
    return cut.rstrip(" ,.;:") + "…"


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")


def _json(meta: Mapping | None) -> str | None:
    """meta as stored: one spelling per value, so that an unchanged answer compares equal."""
    return None if meta is None else json.dumps(meta, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _exported(m: Message) -> dict:
    doc = {**asdict(m), "created": _iso(m.created)}
    if m.meta is None:
        del doc["meta"]
    return doc


class ChatStore:
    """Chats and their messages in the SQLite file at `path`, created with its folder. The chats
    are the user's alone: the folder is made (or narrowed to) 0700 and the file, with SQLite's
    -wal and -shm beside it, 0600; SQLite gives the files it makes the database file's mode."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            private_folder(self.path.parent)
        except OSError as e:
            raise StoreError(f"Cannot create the folder for saved chats {self.path.parent}: {e.strerror or e}.") from e
        try:
            private_file(self.path)
            for sidecar in (self.path.with_name(self.path.name + end) for end in ("-wal", "-shm")):
                if sidecar.exists():
                    narrow(sidecar, FILE_MODE)
        except OSError as e:
            raise StoreError(f"Cannot make the saved chats {self.path} private: {e.strerror or e}.") from e
        self._migrate()

    # ------------------------------------------------------------ connections

    @contextmanager
    def _transaction(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection inside one transaction, committed on success and closed either way.
        Writes take the lock up front (BEGIN IMMEDIATE): a read-then-write never races another."""
        con = None
        try:
            con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            con.execute("PRAGMA foreign_keys = ON")
            # In WAL mode NORMAL still survives the app being killed; only power loss can undo
            # the last commits, and the file stays consistent either way.
            con.execute("PRAGMA synchronous = NORMAL")
            con.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            yield con
            con.execute("COMMIT")
        except sqlite3.Error as e:
            done = "written" if write else "read"
            raise StoreError(f"The saved chats in {self.path} could not be {done}: {e}.") from e
        finally:
            if con is not None:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                con.close()

    def _migrate(self) -> None:
        try:
            with closing(sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)) as con:
                mode = con.execute("PRAGMA journal_mode = WAL").fetchone()[0]  # persistent: stored in the file
        except sqlite3.Error as e:
            raise StoreError(f"Cannot open the saved chats in {self.path}: {e}.") from e
        if mode != "wal":  # e.g. a network drive: still safe, but reads wait for writes
            log.warning("Saved chats in %s use journal mode %s, not WAL", self.path, mode)
        with self._transaction(write=True) as con:
            version = con.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"The saved chats in {self.path} were written by a newer Aerie "
                                 f"(format {version}, this one reads up to {SCHEMA_VERSION}). Update Aerie.")
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[step]:
                    con.execute(statement)
                con.execute(f"PRAGMA user_version = {step}")

    # ------------------------------------------------------------ reading

    @staticmethod
    def _info(con: sqlite3.Connection, chat_id: int) -> ChatInfo:
        row = con.execute("SELECT id, COALESCE(title, ?), created, updated FROM chats WHERE id = ?",
                          (UNTITLED, chat_id)).fetchone()
        if row is None:
            raise ChatNotFoundError("This chat no longer exists; it may have been deleted in another tab.")
        return ChatInfo(*row)

    @staticmethod
    def _messages(con: sqlite3.Connection, chat_id: int) -> list[tuple[int, Message]]:
        rows = con.execute("SELECT id, role, content, created, meta FROM messages WHERE chat_id = ? ORDER BY id",
                           (chat_id,))
        return [(row_id, Message(role, content, created, None if meta is None else json.loads(meta)))
                for row_id, role, content, created, meta in rows]

    def chats(self, limit: int | None = None, containing: str = "") -> list[ChatInfo]:
        """The chats, the most recently updated first: at most `limit` (None: all); with
        `containing`, only those whose title or a message holds it (case-insensitive for ASCII)."""
        where, args = "", [UNTITLED]
        if containing:
            pattern = "%" + containing.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where = (" WHERE COALESCE(title, ?) LIKE ? ESCAPE '\\' OR id IN "
                     "(SELECT chat_id FROM messages WHERE content LIKE ? ESCAPE '\\')")
            args += [UNTITLED, pattern, pattern]
        with self._transaction() as con:
            rows = con.execute("SELECT id, COALESCE(title, ?), created, updated FROM chats" + where +
                               " ORDER BY updated DESC, id DESC LIMIT ?",
                               (*args, -1 if limit is None else limit)).fetchall()
        return [ChatInfo(*row) for row in rows]

    def chat(self, chat_id: int) -> ChatInfo:
        with self._transaction() as con:
            return self._info(con, chat_id)

    def messages(self, chat_id: int) -> list[Message]:
        with self._transaction() as con:
            self._info(con, chat_id)
            return [m for _, m in self._messages(con, chat_id)]

    # ------------------------------------------------------------ writing

    def create_chat(self, title: str | None = None) -> ChatInfo:
        """A new, empty chat; without a title it takes one from its first user message."""
        now = time.time()
        with self._transaction(write=True) as con:
            cur = con.execute("INSERT INTO chats (title, created, updated) VALUES (?, ?, ?)",
                              ((title or "").strip() or None, now, now))
            return self._info(con, cur.lastrowid)

    @staticmethod
    def _append(con: sqlite3.Connection, chat_id: int, role: str, content: str, now: float,
                meta: str | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        con.execute("INSERT INTO messages (chat_id, role, content, created, meta) VALUES (?, ?, ?, ?, ?)",
                    (chat_id, role, content, now, meta))
        if role == "user" and content.strip():
            con.execute("UPDATE chats SET title = ? WHERE id = ? AND title IS NULL", (title_from(content), chat_id))

    @staticmethod
    def _touch(con: sqlite3.Connection, chat_id: int, now: float) -> None:
        con.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))

    def append(self, chat_id: int, role: str, content: str) -> None:
        now = time.time()
        with self._transaction(write=True) as con:
            self._info(con, chat_id)
            self._append(con, chat_id, role, content, now)
            self._touch(con, chat_id, now)

    def update_last(self, chat_id: int, content: str) -> None:
        """Replace the text of the chat's last message, which must be an answer (it is streaming)."""
        now = time.time()
        with self._transaction(write=True) as con:
            self._info(con, chat_id)
            stored = self._messages(con, chat_id)
            if not stored or stored[-1][1].role != "assistant":
                raise ValueError(f"the last message of chat {chat_id} is not an answer")
            con.execute("UPDATE messages SET content = ? WHERE id = ?", (content, stored[-1][0]))
            self._touch(con, chat_id, now)

    def sync(self, chat_id: int, chat: Sequence[Mapping]) -> None:
        """Make the chat's messages (and answers' "meta") equal `chat`, rewriting only the tail that
        differs: while an answer streams that is one UPDATE of its last message; after a regenerate
        or a failed answer, the dropped messages are deleted. Nothing changed = nothing written."""
        wanted = [(m["role"], m["content"], _json(m.get("meta"))) for m in chat]
        now = time.time()
        with self._transaction(write=True) as con:
            self._info(con, chat_id)
            stored = self._messages(con, chat_id)
            have = [(m.role, m.content, _json(m.meta)) for _, m in stored]
            same = 0
            while same < min(len(have), len(wanted)) and have[same] == wanted[same]:
                same += 1
            if same == len(stored) == len(wanted):
                return
            if same == len(stored) - 1 == len(wanted) - 1 and have[same][0] == wanted[same][0]:
                con.execute("UPDATE messages SET content = ?, meta = ? WHERE id = ?",
                            (wanted[same][1], wanted[same][2], stored[same][0]))
            else:
                if same < len(stored):
                    con.execute("DELETE FROM messages WHERE chat_id = ? AND id >= ?", (chat_id, stored[same][0]))
                for role, content, meta in wanted[same:]:
                    self._append(con, chat_id, role, content, now, meta)
            self._touch(con, chat_id, now)

    def rename(self, chat_id: int, title: str) -> ChatInfo:
        title = " ".join(str(title or "").split())
        if not title:
            raise StoreError("A chat needs a title: type one, then Rename.")
        with self._transaction(write=True) as con:
            self._info(con, chat_id)
            con.execute("UPDATE chats SET title = ?, updated = ? WHERE id = ?", (title, time.time(), chat_id))
            return self._info(con, chat_id)

    def delete(self, chat_id: int) -> None:
        with self._transaction(write=True) as con:
            self._info(con, chat_id)
            con.execute("DELETE FROM chats WHERE id = ?", (chat_id,))  # its messages go by ON DELETE CASCADE

    # ------------------------------------------------------------ export

    def _snapshot(self, chat_id: int) -> tuple[ChatInfo, list[Message]]:
        with self._transaction() as con:
            return self._info(con, chat_id), [m for _, m in self._messages(con, chat_id)]

    def export_json(self, chat_id: int) -> str:
        """The chat as a JSON document: title, times (ISO 8601, local offset) and messages."""
        info, messages = self._snapshot(chat_id)
        doc = {"format": "aerie-chat", "version": EXPORT_VERSION, "title": info.title,
               "created": _iso(info.created), "updated": _iso(info.updated),
               "messages": [_exported(m) for m in messages]}
        return json.dumps(doc, ensure_ascii=False, indent=2) + "\n"

    def export_markdown(self, chat_id: int) -> str:
        """The chat as Markdown: the title, when it was written, then one section per message."""
        info, messages = self._snapshot(chat_id)
        when = datetime.fromtimestamp(info.updated).astimezone().strftime("%Y-%m-%d %H:%M %Z").strip()
        parts = [f"# {info.title}", f"*A chat with Aerie, {len(messages)} messages, last changed {when}.*"]
        parts += [f"## {SPEAKERS[m.role]}\n\n{m.content.strip()}" for m in messages]
        return "\n\n".join(parts) + "\n"
